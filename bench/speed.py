"""Single-stream speed, start-up and memory beside llama.cpp and transformers, in one run.

    make bench                      # = python bench/speed.py
    python bench/speed.py [--threads N] [--reps 3] [--device cpu|cuda] [--skip-transformers] [--skip-llama]

Same model file (the default Gemma 3 270M Q4_K_M GGUF), same prompt token ids, same
thread count, one process tree:
- llorch in-process: the model runner fed directly (int8 blocks, and --dequantize's
  float weights as the before-figure), greedy;
- llorch over HTTP: a worker process, one streamed /execute job per repetition;
- llama.cpp in-process: PyPI's llama-cpp-python (the `bench` extra), greedy;
- llama.cpp over HTTP: its own `llama-server` (built once, bench/llama_server.py);
- transformers' generate (float32), greedy.
Figures: prefill tokens/s at 512 prompt tokens (= 512 / time to first token), decode
tokens/s over 128 tokens, time to first token, start-to-ready (process start to
/health ready, warm caches), peak resident memory (VmHWM) of each server with one
slot of 4096 tokens. Medians over --reps with min..max; ratios are to llama.cpp.
The roofline divides measured memory bandwidth by the bytes of weights one decoded
token reads. Writes bench/results/speed-<timestamp>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from launch import free_port, start_server
from llorch.engine.kv.pool import BLOCK_SIZE, bytes_per_block
from llorch.engine.runner import ModelRunner, Segment
from llorch.weights.default_model import default_model_path
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import LoadedModel, load_model
from soak import rss_mb

PROMPT_TOKENS = 512
DECODE_TOKENS = 128
SERVER_CONTEXT = 4096
RESULTS = Path(__file__).parent / "results"
METRICS = ("prefill_tok_s", "decode_tok_s", "ttft_s", "start_to_ready_s", "peak_rss_mb")
HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s"}


def prompt_ids(loaded: LoadedModel) -> list[int]:
    """Exactly PROMPT_TOKENS ids (BOS first) of ordinary English text."""
    text = " ".join(f"Item {i} of the inventory is a box of {i % 7 + 2} red apples." for i in range(200))
    return loaded.tokenizer.encode(text)[:PROMPT_TOKENS]


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs), "reps": len(runs)} for key in runs[0]}


def timed_greedy(prefill: Callable[[], int], step: Callable[[int, int], int]) -> dict[str, float]:
    started = time.perf_counter()
    token = prefill()
    ttft = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(DECODE_TOKENS):
        token = step(token, i)
    decode = time.perf_counter() - started
    return {"prefill_tok_s": PROMPT_TOKENS / ttft, "decode_tok_s": DECODE_TOKENS / decode, "ttft_s": ttft}


# -- in-process engines --------------------------------------------------------------------------
def bench_llorch(loaded: LoadedModel, ids: list[int], device: torch.device) -> dict[str, float]:
    tokens = PROMPT_TOKENS + DECODE_TOKENS + 1
    runner = ModelRunner(loaded.model, device, loaded.dtype, kv_cache_bytes=(tokens // BLOCK_SIZE + 3)
                         * bytes_per_block(loaded.config, loaded.dtype))
    blocks = list(range(1, runner.kv.num_blocks))

    def forward(segment: Segment) -> int:
        with torch.inference_mode():
            return int(torch.argmax(runner.forward([segment])[0]))

    return timed_greedy(lambda: forward(Segment(ids, 0, blocks, True)),
                        lambda token, i: forward(Segment([token], PROMPT_TOKENS + i, blocks, True)))


def llama_cpp_engine(model: Path, threads: int, device: str) -> Any:
    from llama_cpp import Llama, llama_supports_gpu_offload

    if device == "cuda" and not llama_supports_gpu_offload():
        raise RuntimeError("this llama-cpp-python build has no GPU offload")
    return Llama(model_path=str(model), n_ctx=1024, n_batch=PROMPT_TOKENS, n_ubatch=PROMPT_TOKENS,
                 n_threads=threads, n_threads_batch=threads, n_gpu_layers=-1 if device == "cuda" else 0,
                 verbose=False)


def bench_llama_cpp(llm: Any, ids: list[int]) -> dict[str, float]:
    def next_token() -> int:  # argmax of the last evaluated token's logits, as ours is
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    def prefill() -> int:
        llm.reset()
        llm.eval(ids)
        return next_token()

    def step(token: int, _: int) -> int:
        llm.eval([token])
        return next_token()

    return timed_greedy(prefill, step)


def bench_transformers(model: Path, ids: list[int], device: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=dtype).to(device)
    prompt = torch.tensor([ids], device=device)
    greedy = {"do_sample": False, "top_p": None, "top_k": None}
    with torch.inference_mode():
        hf.generate(prompt, max_new_tokens=2, **greedy)  # warm-up
        started = time.perf_counter()
        hf.generate(prompt, max_new_tokens=1, min_new_tokens=1, **greedy)
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        hf.generate(prompt, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1, **greedy)
        decode = time.perf_counter() - started - ttft
    return {"prefill_tok_s": PROMPT_TOKENS / ttft, "decode_tok_s": DECODE_TOKENS / decode, "ttft_s": ttft}


# -- servers -------------------------------------------------------------------------------------
def stream_llorch(http: httpx.Client, prompt: str) -> list[float]:
    """Arrival times of each streamed token of one greedy job."""
    body = {"job_id": f"speed-{time.monotonic_ns()}", "prompt": prompt, "max_tokens": DECODE_TOKENS,
            "temperature": 0}
    arrivals = [time.perf_counter()]
    with http.stream("POST", "/execute", json=body, headers={"accept": "application/x-ndjson"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            event = json.loads(line)
            if event["type"] == "token":
                arrivals.append(time.perf_counter())
            elif event["type"] == "error":
                raise RuntimeError(event["message"])
    return arrivals


def stream_llama_server(http: httpx.Client, prompt: str) -> list[float]:
    body = {"prompt": prompt, "n_predict": DECODE_TOKENS, "temperature": 0, "stream": True, "cache_prompt": False}
    arrivals = [time.perf_counter()]
    with http.stream("POST", "/completion", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("content"):
                arrivals.append(time.perf_counter())
    return arrivals


def bench_server(command: list[str], url: str, ready: Callable[[httpx.Response], bool],
                 stream: Callable[[httpx.Client, str], list[float]], prompt: str, reps: int
                 ) -> tuple[list[dict[str, float]], list[float]]:
    """Per-rep streamed figures, and start-to-ready of each (re)start; peak RSS over the whole run."""
    process = start_server(command, url, ready).process  # the first start fills caches: not a warm start
    process.terminate()
    process.wait(30)
    runs, starts = [], []
    for _ in range(reps):
        server = start_server(command, url, ready)
        process, seconds = server.process, server.start_to_ready_s
        starts.append(seconds)
        try:
            with httpx.Client(base_url=url, timeout=600) as http:
                stream(http, prompt)  # warm-up request
                arrivals = stream(http, prompt)
            first, tokens = arrivals[1] - arrivals[0], len(arrivals) - 1
            runs.append({"prefill_tok_s": PROMPT_TOKENS / first, "ttft_s": first,
                         "decode_tok_s": (tokens - 1) / (arrivals[-1] - arrivals[1]),
                         "peak_rss_mb": rss_mb(process.pid, "VmHWM")})
        finally:
            process.terminate()
            process.wait(30)
    return runs, starts


def llorch_server(args: argparse.Namespace, prompt: str, extra: list[str]) -> dict[str, Any]:
    port = free_port()
    program = "llorch-cuda-worker" if args.device == "cuda" else "llorch-cpu-worker"
    command = [str(Path(sys.executable).parent / program), "--port", str(port), "--threads", str(args.threads),
               "--max-running", "1", "--ctx-size", str(SERVER_CONTEXT), "--log-level", "warning",
               "--no-prefix-cache", *extra]  # every rep reads its whole prompt, as llama-server's do
    runs, starts = bench_server(command, f"http://127.0.0.1:{port}", lambda r: r.json().get("status") == "healthy",
                                stream_llorch, prompt, args.reps)
    return {**summarize(runs), "start_to_ready_s": summarize([{"s": s} for s in starts])["s"]}


def llama_server(args: argparse.Namespace, model: Path, prompt: str) -> dict[str, Any]:
    from llama_server import ensure_llama_server

    port = free_port()
    command = [str(ensure_llama_server()), "-m", str(model), "--port", str(port), "-t", str(args.threads),
               "-tb", str(args.threads), "-np", "1", "-c", str(SERVER_CONTEXT), "--no-webui"]
    runs, starts = bench_server(command, f"http://127.0.0.1:{port}", lambda r: r.status_code == 200,
                                stream_llama_server, prompt, args.reps)
    return {**summarize(runs), "start_to_ready_s": summarize([{"s": s} for s in starts])["s"]}


# -- roofline ------------------------------------------------------------------------------------
def memory_bandwidth_gb_s() -> float:
    """Read bandwidth: the best of several sums over a buffer far larger than the caches."""
    buffer = torch.ones(2**28 // 4 * 4, dtype=torch.float32)  # 1 GiB
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes one decoded token reads: every matrix once (the tied embedding as the output
    projection); the embedding lookup itself reads one row."""
    return sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())


# -- report --------------------------------------------------------------------------------------
def run_all(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model = default_model_path()
    results: dict[str, Any] = {"model": model.name, "device": args.device, "threads": args.threads,
                               "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS,
                               "reps": args.reps, "engines": {}}
    engines = results["engines"]
    quantized = load_model(model, device, torch.float32 if args.device == "cpu" else torch.bfloat16,
                           keep_quantized=True)
    ids = prompt_ids(quantized)
    prompt = quantized.tokenizer.decode(ids[1:])  # without BOS: both servers add it
    label = "llorch int8 (in-process)" if args.device == "cpu" else "llorch bf16 (in-process)"
    print(label, flush=True)
    bench_llorch(quantized, ids, device)
    engines[label] = summarize([bench_llorch(quantized, ids, device) for _ in range(args.reps)])
    if args.device == "cpu":
        dense = load_model(model, device, torch.float32)
        print("llorch float32 weights (in-process, --dequantize)", flush=True)
        bench_llorch(dense, ids, device)
        engines["llorch f32 --dequantize (in-process)"] = summarize(
            [bench_llorch(dense, ids, device) for _ in range(args.reps)])
        results["bytes_per_token"] = {"llorch int8": weight_bytes(quantized), "llorch f32": weight_bytes(dense)}
        del dense
    print("llorch worker (HTTP)", flush=True)
    engines["llorch (HTTP)"] = llorch_server(args, prompt, [])
    if not args.skip_llama:
        try:
            llm = llama_cpp_engine(model, args.threads, args.device)
        except (ImportError, RuntimeError) as exc:
            results["llama_cpp_unavailable"] = str(exc)
            print(f"llama.cpp in-process unavailable: {exc}", flush=True)
        else:
            print("llama.cpp (in-process)", flush=True)
            bench_llama_cpp(llm, ids)
            engines["llama.cpp (in-process)"] = summarize([bench_llama_cpp(llm, ids) for _ in range(args.reps)])
            del llm
        if args.device == "cpu":
            print("llama.cpp server (HTTP)", flush=True)
            engines["llama.cpp (HTTP)"] = llama_server(args, model, prompt)
        gguf = GGUFFile(model)
        results.setdefault("bytes_per_token", {})["llama.cpp"] = sum(t.nbytes for t in gguf.tensors.values())
    if not args.skip_transformers:
        print("transformers generate", flush=True)
        engines["transformers f32 (in-process)"] = summarize([bench_transformers(model, ids, args.device)])
    if args.device == "cpu":
        results["memory_bandwidth_gb_s"] = memory_bandwidth_gb_s()
    return results


def reference_for(name: str) -> str:
    return "llama.cpp (HTTP)" if name.endswith("(HTTP)") else "llama.cpp (in-process)"


def report(results: dict[str, Any]) -> None:
    engines = results["engines"]
    print(f"\n{results['model']} on {results['device']}, {results['threads']} threads, prompt {PROMPT_TOKENS} tokens,"
          f" decode {DECODE_TOKENS}; median (min..max) of {results['reps']} reps; ratio = ours / llama.cpp, "
          "higher is better for tok/s, lower for the rest\n")
    header = ["engine", "prefill tok/s", "decode tok/s", "TTFT s", "start-to-ready s", "peak RSS MB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, figures in engines.items():
        reference = engines.get(reference_for(name))
        cells = [name]
        for metric in METRICS:
            if metric not in figures:
                cells.append("-")
                continue
            m = figures[metric]
            cell = f"{m['median']:.3g} ({m['min']:.3g}..{m['max']:.3g})"
            if reference is not None and reference is not figures and metric in reference:
                cell += f" **{m['median'] / reference[metric]['median']:.2f}x**"
            cells.append(cell)
        print("| " + " | ".join(cells) + " |")
    if "memory_bandwidth_gb_s" in results and "bytes_per_token" in results:
        bandwidth = results["memory_bandwidth_gb_s"]
        print(f"\nroofline: measured read bandwidth {bandwidth:.1f} GB/s")
        for name, size in results["bytes_per_token"].items():
            print(f"  {name:12s} {size / 1e6:7.1f} MB of weights per token -> at most {bandwidth * 1e9 / size:6.1f} "
                  "decode tok/s")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = results["engines"]
    names = list(engines)
    figure, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4.5))
    titles = {"prefill_tok_s": "prefill tok/s (512)", "decode_tok_s": "decode tok/s (128)", "ttft_s": "TTFT s",
              "start_to_ready_s": "start-to-ready s", "peak_rss_mb": "peak RSS MB"}
    colors = ["tab:blue" if n.startswith("llorch") else "tab:orange" if "llama" in n else "tab:gray" for n in names]
    for axis, metric in zip(axes, METRICS, strict=True):
        spans = [engines[n].get(metric, {"median": 0, "min": 0, "max": 0}) for n in names]
        medians = [s["median"] for s in spans]
        low, high = [s["median"] - s["min"] for s in spans], [s["max"] - s["median"] for s in spans]
        axis.barh(range(len(names)), medians, xerr=[low, high], color=colors)
        axis.set_yticks(range(len(names)), names if axis is axes[0] else [""] * len(names), fontsize=8)
        axis.invert_yaxis()
        axis.set_title(titles[metric] + (" (higher better)" if metric in HIGHER_IS_BETTER else " (lower better)"),
                       fontsize=9)
    figure.suptitle(f"{results['model']}, {results['device']}, {results['threads']} threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    if args.threads is None:
        from llorch.device import physical_cores

        args.threads = physical_cores()
    torch.set_num_threads(args.threads)
    results = run_all(args)
    report(results)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"speed-{args.device}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
