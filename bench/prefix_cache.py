"""What the prefix cache saves on a shared-system-prompt workload, in-process, with and without it.

    python bench/prefix_cache.py [--threads 2] [--jobs 8] [--system-words 250]

Jobs share one long system prompt and differ in a short question; they arrive one
after another (each after the previous one's first token), as chat turns do. Reports
prompt tokens actually computed, prompt tokens served from the cache, and the median
time to first token, for the engine with and without prefix caching.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llorch.engine.config import EngineConfig
from llorch.engine.factory import build_engine
from llorch.engine.request import Event, GenerationRequest, SamplingParams, TokenText
from llorch.kernels import build as kernels

SYSTEM_SENTENCE = ("You are a careful assistant for a travel agency; answer briefly, cite no sources, "
                   "and stay polite even when the user is not.")
QUESTIONS = ["What is the capital of Italy?", "Name a red fruit.", "What is 2 + 2?", "Say hello in French.",
             "Which planet is largest?", "Spell 'cat' backwards.", "What colour is the sky?", "Count to three."]


def measure(prefix_caching: bool, args: argparse.Namespace, system: str) -> dict[str, float]:
    engine = build_engine(EngineConfig(dtype="f32", ctx_size=4096, kv_cache_bytes=256 * 2**20,
                                       prefix_caching=prefix_caching))
    engine.start()
    ttfts, prompt_tokens = [], 0
    try:
        for i in range(args.jobs):
            prompt = f"{system}\nUser: {QUESTIONS[i % len(QUESTIONS)]}\nAssistant:"
            request = GenerationRequest(f"job-{i}", prompt, 4, SamplingParams(temperature=0.0))
            job = engine.prepare(request)
            prompt_tokens += len(job.prompt_ids)
            first = [0.0]
            done = [False]

            def emit(event: Event, first: list[float] = first, done: list[bool] = done) -> None:
                if isinstance(event, TokenText) and not first[0]:
                    first[0] = time.perf_counter()
                done[0] = done[0] or event.terminal

            sent = time.perf_counter()
            engine.submit(job, emit)
            while not done[0]:
                time.sleep(0.005)
            ttfts.append(first[0] - sent)
        hits = engine.stats().prefix_cache_hit_tokens
    finally:
        engine.stop()
    return {"prompt_tokens": prompt_tokens, "computed": prompt_tokens - hits, "from_cache": hits,
            "ttft_p50_s": statistics.median(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=250)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)  # the C step's own count
    words = SYSTEM_SENTENCE.split()
    system = " ".join(words[i % len(words)] for i in range(args.system_words))
    print("| prefix cache | prompt tokens | computed | from cache | TTFT p50 (s) |\n|---|---|---|---|---|")
    for enabled in (False, True):
        r = measure(enabled, args, system)
        print(f"| {'on' if enabled else 'off'} | {r['prompt_tokens']} | {r['computed']:.0f} | "
              f"{r['from_cache']:.0f} | {r['ttft_p50_s']:.3f} |")


if __name__ == "__main__":
    main()
