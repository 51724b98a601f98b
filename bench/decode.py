"""Decode/prefill speed, time to first token and start-to-ready, beside transformers, in one run.

    python bench/decode.py [--threads N] [--reps 3] [--skip-transformers]

Prints a table and writes bench/results/decode-<timestamp>.json. Figures are medians
over repetitions with min..max spread.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from llorch.engine.runner import BLOCK_SIZE, ModelRunner, Segment
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model

PROMPT_TOKENS = 512
DECODE_TOKENS = 128


def prompt_ids(loaded: LoadedModel, count: int) -> list[int]:
    ids = loaded.tokenizer.encode(" ".join(f"word{i}" for i in range(count)))
    return ids[:count]


def bench_llorch(loaded: LoadedModel) -> dict[str, float]:
    tokens = PROMPT_TOKENS + DECODE_TOKENS + 1
    runner = ModelRunner(loaded.model, torch.device("cpu"), loaded.dtype,
                         kv_cache_bytes=(tokens // BLOCK_SIZE + 3) * ModelRunner.bytes_per_block(
                             loaded.config, loaded.dtype))
    blocks = list(range(1, runner.num_blocks))
    ids = prompt_ids(loaded, PROMPT_TOKENS)
    start = time.perf_counter()
    token = int(torch.argmax(runner.forward([Segment(ids, 0, blocks, True)])[0]))
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(DECODE_TOKENS):
        token = int(torch.argmax(runner.forward([Segment([token], PROMPT_TOKENS + step, blocks, True)])[0]))
    decode = time.perf_counter() - start
    return {"prefill_tok_s": PROMPT_TOKENS / ttft, "decode_tok_s": DECODE_TOKENS / decode, "ttft_s": ttft}


def bench_transformers(model_path: Path, loaded: LoadedModel) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    ids = torch.tensor([prompt_ids(loaded, PROMPT_TOKENS)])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1, do_sample=False)
        decode = time.perf_counter() - start - ttft
    return {"prefill_tok_s": PROMPT_TOKENS / ttft, "decode_tok_s": DECODE_TOKENS / decode, "ttft_s": ttft}


def start_to_ready(threads: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exe = Path(sys.executable).parent / "llorch-cpu-worker"
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), "--port", str(port), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                # /health answers while loading; ready means healthy.
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json().get("status") == "healthy":
                    return time.perf_counter() - start
            except httpx.HTTPError:
                time.sleep(0.02)
            if proc.poll() is not None:
                raise RuntimeError("worker exited during start-up")
    finally:
        proc.terminate()
        proc.wait()


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = default_model_path()
    loaded = load_model(model_path, torch.device("cpu"), torch.float32)

    results: dict[str, Any] = {"threads": args.threads, "prompt_tokens": PROMPT_TOKENS,
                               "decode_tokens": DECODE_TOKENS, "model": str(model_path)}
    bench_llorch(loaded)  # warm-up
    results["llorch_f32"] = summarize([bench_llorch(loaded) for _ in range(args.reps)])
    results["llorch_start_to_ready_s"] = summarize(
        [{"s": start_to_ready(args.threads)} for _ in range(args.reps)])["s"]
    if not args.skip_transformers:
        results["transformers_f32"] = summarize([bench_transformers(model_path, loaded) for _ in range(1)])

    print(f"threads={args.threads} prompt={PROMPT_TOKENS} decode={DECODE_TOKENS}")
    print(f"{'engine':<18}{'prefill tok/s':>15}{'decode tok/s':>15}{'TTFT s':>10}")
    for name in ("llorch_f32", "transformers_f32"):
        if name in results:
            r = results[name]
            print(f"{name:<18}{r['prefill_tok_s']['median']:>15.1f}{r['decode_tok_s']['median']:>15.2f}"
                  f"{r['ttft_s']['median']:>10.3f}")
    s = results["llorch_start_to_ready_s"]
    print(f"llorch start-to-ready: {s['median']:.2f} s (min {s['min']:.2f}, max {s['max']:.2f})")
    out = Path(__file__).parent / "results" / f"decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
