"""What scoring a prompt costs: prompt tokens per second read plain, and read with every row scored.

    python bench/scoring.py [--tokens 512] [--reps 3] [--top 1]

In-process, default model. "plain" reads the prompt and samples one token (only the last
row's logits are computed); "scored" reads the same prompt with max_tokens=0 and
prompt_logprobs (every row's logits, reduced on the device to the chosen token's and the
top-k log-probabilities), as an evaluation's loglikelihood request does. The difference
is the vocabulary projection of every prompt row.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from llorch.engine.config import EngineConfig
from llorch.engine.engine import Engine
from llorch.engine.factory import build_engine
from llorch.engine.request import Event, GenerationRequest, SamplingParams


def timed(engine: Engine, job_id: str, ids: list[int], scored: bool, top: int) -> float:
    done = threading.Event()

    def emit(event: Event) -> None:
        if event.terminal:
            done.set()

    request = GenerationRequest(job_id, None, 0 if scored else 1, SamplingParams(temperature=0.0),
                                prompt_ids=tuple(ids), prompt_logprobs=top if scored else None)
    started = time.perf_counter()
    engine.submit(engine.prepare(request), emit)
    done.wait()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=1)
    args = parser.parse_args()
    engine = build_engine(EngineConfig(ctx_size=4096, kv_cache_bytes=256 * 2**20, prefix_caching=False))
    engine.start()
    tokenizer = engine.front.tokenizer
    words = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 200)
    ids = tokenizer.encode(words)[: args.tokens]
    try:
        timed(engine, "warm", ids[:64], True, args.top)
        results: dict[str, list[float]] = {"plain": [], "scored": []}
        for rep in range(args.reps):  # alternating, so both see the same machine
            for kind in results:
                results[kind].append(args.tokens / timed(engine, f"{kind}-{rep}", ids, kind == "scored", args.top))
    finally:
        engine.stop()
    for kind, rates in results.items():
        print(f"{kind:>7}: {statistics.median(rates):8.1f} prompt tokens/s (median of {args.reps}; "
              f"{', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
