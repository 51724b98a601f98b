"""The engine's own time per generated token: scheduling, sampling, detokenizing, stop matching, events.

    python bench/engine_overhead.py [--threads 2] [--streams 1,16] [--lengths 64,2048]

The model is replaced by a stand-in runner whose forward costs next to nothing: it
returns rows of a fixed bank of logits over the default model's 262k-token
vocabulary (each row peaked on a different ordinary token, so the detokenizer sees
real text). The tokenizer, sampler and every other engine part are the real ones.
What is measured is therefore the engine's work per token, which must not grow with
the output's length or with the number of streams beyond the batch's own rows.
Reported: milliseconds of engine time per generated token (wall time of all jobs
minus the stand-in's forward time, over all tokens), greedy and sampled.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from llorch.engine.config import EngineConfig
from llorch.engine.engine import Engine
from llorch.engine.factory import decoder_engine
from llorch.engine.request import Event, GenerationRequest, SamplingParams
from llorch.engine.telemetry import Telemetry
from llorch.kernels import build as kernels
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import load_model

BANK_ROWS = 257


@dataclass
class StandInPool:
    num_blocks: int
    block_size: int = 16
    block_bytes: int = 1

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


class StandInRunner:
    """Answers a step with logits rows from a fixed bank: the engine's work is all that is left."""

    def __init__(self, vocab: int, token_ids: list[int]) -> None:
        self.device = torch.device("cpu")
        self.config = type("Config", (), {"vocab_size": vocab})()
        self.kv = StandInPool(num_blocks=8192)
        self.weight_bytes = 0
        self.resident_bytes = 0
        self.prompt_kernel = False  # every row is a decoding row (no separate prompt kernel)
        generator = torch.Generator().manual_seed(0)
        self.bank = torch.randn(BANK_ROWS, vocab, generator=generator)
        for row in range(BANK_ROWS):  # peaked on ordinary tokens: the text stays real
            self.bank[row, token_ids[row % len(token_ids)]] += 12.0
        self.forward_seconds = 0.0
        self._step = 0

    def best_of(self, logits: torch.Tensor) -> None:  # the C step's own argmax: not here, the sampler finds it
        return None

    def forward(self, segments: list[Any]) -> torch.Tensor:
        started = time.perf_counter()
        wanted = [i for i, s in enumerate(segments) if s.wants_logits]
        rows = torch.tensor([(self._step + i) % BANK_ROWS for i in wanted], dtype=torch.long)
        self._step += 1
        logits = self.bank[rows]
        self.forward_seconds += time.perf_counter() - started
        return logits


def measure(engine: Engine, runner: StandInRunner, streams: int, length: int, sampling: SamplingParams
            ) -> float:
    done = threading.Event()
    tokens, ended = [0], [0]

    def emit(event: Event) -> None:  # on the engine thread: must not block
        if event.terminal:
            tokens[0] += event.tokens_out  # type: ignore[attr-defined]
            ended[0] += 1
            if ended[0] == streams:
                done.set()

    runner.forward_seconds = 0.0
    started = time.perf_counter()
    for i in range(streams):
        job = engine.prepare(GenerationRequest(f"overhead-{streams}-{length}-{i}-{time.monotonic_ns()}",
                                               "Once upon a time", length, sampling))
        engine.submit(job, emit)
    done.wait()
    wall = time.perf_counter() - started
    return (wall - runner.forward_seconds) / tokens[0] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)  # the C step's own count
    loaded = load_model(default_model_path(), torch.device("cpu"), torch.float32, keep_quantized=True)
    tokenizer = loaded.tokenizer
    words = tokenizer.encode("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
                             "boxing, and every kettle hums; café, naïve, 東京, ✓", add_special_tokens=False)
    runner = StandInRunner(loaded.config.vocab_size, words)
    tokenizer = type(tokenizer)(tokenizer.backend, tokenizer.bos_token_id, frozenset(), tokenizer.special_ids,
                                tokenizer.byte_token_ids)  # no end-of-generation id: every job runs its length
    config = EngineConfig(ctx_size=8192, max_running=max(args.streams), max_queue=max(args.streams)
                          ).with_limits("generate")
    engine = decoder_engine(runner, tokenizer, config, None, None, Telemetry(),  # type: ignore[arg-type]
                            model_name="stand-in", model_id="stand-in")
    engine.start()
    try:
        measure(engine, runner, 1, 32, SamplingParams(temperature=0.8, seed=0))  # warm-up: first-call costs
        print("| streams | output tokens | greedy ms/token | sampled ms/token |\n|---|---|---|---|")
        for streams in args.streams:
            for length in args.lengths:
                greedy = measure(engine, runner, streams, length, SamplingParams(temperature=0.0))
                sampled = measure(engine, runner, streams, length, SamplingParams(temperature=0.8, seed=1))
                print(f"| {streams} | {length} | {greedy:.3f} | {sampled:.3f} |", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
