"""The CUDA worker beside llama.cpp's CUDA build on one GPU: the figures the GPU work starts from.

    python bench/cuda_probe.py --llama-source DIR --tokenizer DIR [--llama-build DIR] [--out DIR] [--deadline EPOCH]

A random Llama of TinyLlama's shape (bench/models.py's "1b") is built on this machine and turned
into F16 GGUF by llama.cpp's converter from the pinned source (DIR is its unpacked llama.cpp); with a
CUDA build of that source (--llama-build, holding bin/), it is also quantized to Q4_K_M. Rows:
- llorch in-process (the engine, no HTTP): one stream's decode, the time to the first token of a
  512-token prompt, aggregate tokens/s at 8 / 32 / 64 streams, and decode steps under torch's profiler
  (kernels launched per step, host time against GPU time);
- llorch over HTTP (llorch-cuda-worker): aggregate tokens/s and TTFT at 1 / 8 / 32 / 64 clients, and
  the GPU memory it holds;
- llama.cpp: llama-bench (pp512, tg128) on the Q4_K_M and F16 files, and llama-server with 64 slots at
  the same client counts.
llorch's CUDA path dequantizes GGUF weights to bfloat16 when it loads them, so its rows run the same
work from either file. Each row is measured on its own: one that fails prints why, the rest still
print. Results go to OUT/cuda-probe.json as well.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from concurrency import Level, llama_job, llorch_job, run_level
from launch import free_port, llama_healthy, start_server, start_worker, stop
from llama_build import convert_hf_to_gguf
from models import RANDOM_LLAMAS

CLIENTS = (1, 8, 32, 64)
MAX_TOKENS = 64
results: dict[str, Any] = {}


def row(name: str, needs_s: float, deadline: float) -> Callable[[Callable[[], Any]], None]:
    """Run a measurement now, report and keep what it returns, or say why it has no figure."""

    def run(measure: Callable[[], Any]) -> None:
        if time.time() + needs_s > deadline:
            results[name] = "not measured: too little time left"
        else:
            began = time.perf_counter()
            try:
                results[name] = measure()
            except Exception as exc:  # a failing row is reported; the others still run
                results[name] = f"failed: {type(exc).__name__}: {exc}"
            print(f"[{time.perf_counter() - began:6.1f} s] {name}: {json.dumps(results[name])}", flush=True)

    return run


# -- the model -------------------------------------------------------------------------------------
def build_model(work: Path, source: Path, tokenizer: Path, device: str, layers: int | None) -> Path:
    """Random weights (speed does not depend on them) drawn on `device`, and the bench's tokenizer files."""
    import transformers

    directory = work / "hf"
    directory.mkdir(exist_ok=True)
    for file in tokenizer.iterdir():
        shutil.copy2(file, directory / file.name)
    shape = {**RANDOM_LLAMAS["1b"][1], **({"num_hidden_layers": layers} if layers else {})}
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    f16 = work / "llama-1.1b-random-f16.gguf"
    convert_hf_to_gguf(directory, f16, "f16", tool=source)
    return f16


# -- llorch in-process -----------------------------------------------------------------------------
class InProcess:
    def __init__(self, path: Path, device: str) -> None:
        from llorch.engine.config import EngineConfig
        from llorch.engine.factory import build_engine

        self.engine = build_engine(EngineConfig(model=str(path), dtype="bf16", ctx_size=2048, max_running=64,
                                                max_queue=64), device)
        self.engine.start()

    def run(self, prompts: list[str | tuple[int, ...]], max_tokens: int) -> tuple[float, int, list[float]]:
        """Wall seconds, tokens out and each job's seconds to its first token, all jobs at once."""
        from llorch.engine.request import GenerationRequest, SamplingParams

        done, lock = threading.Event(), threading.Lock()
        tokens, ended, first, failures = [0], [0], {}, []
        sent = time.perf_counter()

        def emitter(index: int) -> Callable[[Any], None]:
            def emit(event: Any) -> None:
                with lock:
                    if event.type == "token" and index not in first:
                        first[index] = time.perf_counter() - sent
                    if event.terminal:
                        if event.type == "error":  # the engine thread must not raise: the caller does
                            failures.append(event.message)
                        else:
                            tokens[0] += event.tokens_out
                        ended[0] += 1
                        if ended[0] == len(prompts):
                            done.set()
            return emit

        for i, prompt in enumerate(prompts):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            request = GenerationRequest(f"probe-{time.monotonic_ns()}-{i}", text, max_tokens,
                                        SamplingParams(temperature=0.0, min_tokens=max_tokens), prompt_ids=ids)
            self.engine.submit(self.engine.prepare(request), emitter(i))
        if not done.wait(300):
            raise TimeoutError("jobs did not end in 300 s")
        if failures:
            raise RuntimeError(failures[0])
        return time.perf_counter() - sent, tokens[0], [first[i] for i in sorted(first)]

    def single_stream(self) -> dict[str, float]:
        self.run(["Once upon a time"], 16)  # warm-up: first-call costs excluded
        wall, tokens, first = self.run(["Once upon a time"], 256)
        return {"tok_per_s": round((tokens - 1) / (wall - first[0]), 1), "tokens": tokens}

    def ttft_512(self) -> dict[str, float]:
        # Each prompt differs from its first token on: no cached prefix is reused.
        prompts = [tuple(3 + (7 * i + 131 * n) % 7000 for i in range(512)) for n in range(6)]
        times = [self.run([prompt], 1)[2][0] for prompt in prompts][1:]  # the first warms this length up
        return {"ttft_ms_median": round(sorted(times)[2] * 1000, 2)}

    def aggregate(self) -> dict[str, float]:
        out = {}
        for streams in (8, 32, 64):
            wall, tokens, _ = self.run([f"Job {i}: count from {17 * i} upward:" for i in range(streams)], 128)
            out[f"streams_{streams}_tok_per_s"] = round(tokens / wall, 1)
        return out

    def profile(self) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        self.run(["Once upon a time"], 8)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, tokens, first = self.run(["Once upon a time"], 33)
        steps = tokens - 1
        kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                   and getattr(e, "self_device_time_total", 0) > 0]
        launched = sum(e.count for e in kernels)
        gpu_us = sum(e.self_device_time_total for e in kernels)
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
        return {"steps": steps, "kernels_per_step": round(launched / tokens, 1),
                "host_ms_per_step": round((wall - first[0]) / steps * 1000, 3),
                "gpu_busy_ms_per_step": round(gpu_us / tokens / 1000, 3),
                "top_kernels_us_per_step": {e.key[:80]: round(e.self_device_time_total / tokens, 1) for e in top}}

    def memory(self) -> dict[str, float]:
        return {"resident_gb": round(self.engine.resident_bytes / 1e9, 3),
                "torch_max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3)}

    def close(self) -> None:
        self.engine.stop()


# -- servers over HTTP -----------------------------------------------------------------------------
def levels(url: str, job: Callable[..., tuple[float, int]]) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600) as http:
        job(http, "warm up", 8, "probe-warmup")
    out: dict[str, Any] = {}
    for clients in CLIENTS:
        level: Level = run_level(url, job, clients, 2, MAX_TOKENS)
        out[f"clients_{clients}"] = {"tok_per_s": round(level.tokens_per_s, 1),
                                     "ttft_p50_ms": round(level.percentile(0.5) * 1000, 1)}
    return out


def gpu_used_mb() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout
    return int(text.split()[0])


def llorch_http(path: Path, work: Path, device: str) -> dict[str, Any]:
    idle = gpu_used_mb()
    program = "llorch-cpu-worker" if device == "cpu" else "llorch-cuda-worker"
    worker = start_worker(work, "--model", str(path), "--dtype", "bf16", "--ctx-size", "2048",
                          "--max-running", "64", program=program)
    try:
        health = httpx.get(f"{worker.base_url}/health").json()
        out = levels(worker.base_url, llorch_job)
        out["gpu_mb_held"] = gpu_used_mb() - idle
        out["vram_bytes_reported"] = health.get("vram_bytes")
        out["start_to_ready_s"] = round(worker.start_to_ready_s, 2)
        return out
    finally:
        stop(worker, timeout=30)


def llama_bench(build: Path, path: Path) -> dict[str, float]:
    text = subprocess.run([str(build / "bin" / "llama-bench"), "-m", str(path), "-ngl", "99", "-p", "512",
                           "-n", "128", "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return {f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']}_tok_per_s": round(r["avg_ts"], 1)
            for r in json.loads(text)}


def llama_server(build: Path, path: Path) -> dict[str, Any]:
    idle = gpu_used_mb()
    port = free_port()
    slots = max(CLIENTS)
    server = start_server([str(build / "bin" / "llama-server"), "-m", str(path), "-ngl", "99", "-np", str(slots),
                           "-c", str(slots * 512), "--port", str(port)], f"http://127.0.0.1:{port}", llama_healthy)
    try:
        out = levels(server.base_url, llama_job)
        out["gpu_mb_held"] = gpu_used_mb() - idle
        out["start_to_ready_s"] = round(server.start_to_ready_s, 2)
        return out
    finally:
        stop(server, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-source", type=Path, required=True, help="the pinned source's llama.cpp directory")
    parser.add_argument("--llama-build", type=Path,
                        help="a CUDA build of it (bin/ inside), waited for until a file `ended` appears there")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda-probe"))
    parser.add_argument("--tokenizer", type=Path, required=True, help="the tokenizer files of bench/models.py's Llamas")
    parser.add_argument("--device", default="cuda:0", help="cpu: a dry run of this script on a machine without a GPU")
    parser.add_argument("--layers", type=int, help="fewer layers than the 1B's 22 (a dry run)")
    parser.add_argument("--deadline", type=float, default=time.time() + 3600, help="epoch seconds to finish by")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results["gpu"] = torch.cuda.get_device_name(0) if args.device != "cpu" else "none (dry run)"
    results["torch"] = torch.__version__
    model = args.work / "model"
    model.mkdir(exist_ok=True)
    row("model", 60, args.deadline)(lambda: str(build_model(model, args.llama_source, args.tokenizer,
                                                                       args.device, args.layers)))
    f16 = model / "llama-1.1b-random-f16.gguf"
    if f16.exists():
        try:
            engine = InProcess(f16, args.device)
        except Exception as exc:
            results["in_process"] = f"failed: {type(exc).__name__}: {exc}"
        else:
            try:
                for name, measure, needs in (("single_stream", engine.single_stream, 20),
                                             ("ttft_512", engine.ttft_512, 10), ("profile", engine.profile, 20),
                                             ("aggregate", engine.aggregate, 40), ("memory", engine.memory, 1)):
                    row(f"llorch_in_process_{name}", needs, args.deadline)(measure)
            finally:
                engine.close()
                del engine
                if args.device != "cpu":
                    torch.cuda.empty_cache()
        row("llorch_http", 90, args.deadline)(lambda: llorch_http(f16, args.work, args.device))
    build = args.llama_build
    if build is not None:
        while not (build / "ended").exists() and time.time() + 120 < args.deadline:  # the build's own mark
            time.sleep(2)
        q4 = model / "llama-1.1b-random-q4_k_m.gguf"
        row("llama_quantize", 100, args.deadline)(lambda: subprocess.run(
            [str(build / "bin" / "llama-quantize"), str(f16), str(q4), "Q4_K_M"], check=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode)
        row("llama_bench_q4_k_m", 40, args.deadline)(lambda: llama_bench(build, q4))
        row("llama_server_q4_k_m", 60, args.deadline)(lambda: llama_server(build, q4))
        row("llama_bench_f16", 30, args.deadline)(lambda: llama_bench(build, f16))
    (args.out / "cuda-probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
