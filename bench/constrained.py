"""Constrained decoding's cost: tokens/s with a JSON schema against free text, same engine, same run.

    python bench/constrained.py [--threads 2] [--streams 1,8] [--tokens 128] [--rounds 3]

The default model serves greedy jobs of --tokens tokens in-process (the worker's C step
on the file's blocks), alternating free and constrained rounds. The schema admits an
endless array of short strings, so no constrained job ends before its free twin.
Also reported: the grammar's mask time per token (filling the mask alone, 262k-token
vocabulary) and the one-off cost of the tokenizer view the grammar engine builds on
the first constrained request.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from llorch.engine.config import EngineConfig
from llorch.engine.engine import Engine
from llorch.engine.factory import build_engine
from llorch.engine.masks import fill_mask
from llorch.engine.request import Constraint, Event, GenerationRequest, SamplingParams
from llorch.kernels import build as kernels

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}
PROMPT = "A list of animal names as JSON:"


def run_round(engine: Engine, streams: int, tokens: int, constrained: bool, tag: str) -> float:
    """Aggregate tokens/s of `streams` jobs started together."""
    counts = [0] * streams
    ended = threading.Semaphore(0)  # released from the engine thread, which must never block
    constraint = Constraint("json_schema", json.dumps(SCHEMA), "json_schema") if constrained else None

    def sink(i: int):
        def emit(event: Event) -> None:
            if event.type == "end":
                counts[i] = event.tokens_out
            if event.terminal:
                ended.release()
        return emit

    started = time.perf_counter()
    for i in range(streams):
        request = GenerationRequest(f"{tag}-{i}", PROMPT, tokens, SamplingParams(temperature=0.0),
                                    constraint=constraint)
        engine.submit(engine.prepare(request), sink(i))
    for _ in range(streams):
        ended.acquire()
    return sum(counts) / (time.perf_counter() - started)


def mask_time_ms(engine: Engine, tokens: int = 200) -> float:
    """Median time to fill one mask along a real constrained output."""
    grammar = engine.front.grammars.compile(Constraint("json_schema", json.dumps(SCHEMA), "json_schema"))
    matcher = grammar.matcher()
    text = json.dumps(["zebra", "lion", "giraffe", "cat", "dog", "horse", "eagle"] * 20)
    ids = engine.front.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    bitmask = torch.empty(1, engine.masks.words, dtype=torch.int32)
    times = []
    for token in ids:
        started = time.perf_counter()
        fill_mask(matcher, bitmask[0])
        times.append(time.perf_counter() - started)
        matcher.consume_token(token)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)  # the C step's own count
    engine = build_engine(EngineConfig(ctx_size=1024, max_running=16, prefix_caching=False))
    engine.start()
    started = time.perf_counter()
    engine.front.grammars.ll_tokenizer  # noqa: B018 -- the one-off build, timed here
    print(f"grammar tokenizer view built in {time.perf_counter() - started:.2f} s (first constrained request only)")
    print(f"mask fill, median per token: {mask_time_ms(engine):.3f} ms")
    for streams in map(int, args.streams.split(",")):
        free, bound = [], []
        for r in range(args.rounds):  # alternate, so a noisy neighbour hits both alike
            free.append(run_round(engine, streams, args.tokens, False, f"free-{streams}-{r}"))
            bound.append(run_round(engine, streams, args.tokens, True, f"json-{streams}-{r}"))
        best_free, best_bound = max(free), max(bound)
        print(f"streams={streams:2d}  free {best_free:7.1f} tok/s  constrained {best_bound:7.1f} tok/s  "
              f"ratio {best_bound / best_free:.2f}  (best of {args.rounds}; all: "
              f"{', '.join(f'{x:.0f}' for x in free)} / {', '.join(f'{x:.0f}' for x in bound)})")
    engine.stop()


if __name__ == "__main__":
    main()
