"""Where one decode step's time goes: milliseconds per phase, and the weight bytes per second of each projection.

    python bench/step_profile.py [--models 1b,3b] [--contexts 1,512] [--threads N] [--steps 48] [--skip-llama]
                                 [--streams 1,8,16]

The C step is built once more with LLORCH_PROFILE (kernels/csrc/profile.h): its first thread reads
the clock after each phase's closing barrier, so a phase's time is its slowest thread's, waiting
included. The model is loaded as the CPU worker loads it and decodes one greedy stream at each
context length (a prompt of that many tokens first); llama.cpp decodes the same file at the same
context in the same run, through its Python bindings, for its time per token beside ours. The
read bandwidth is speed.py's (a buffer far larger than the last-level cache); each projection's
GB/s is its weight bytes over its time, and its share of that bandwidth is how close it runs to
the roofline.
With --streams S > 1, S streams decode together, one row each per step (a worker serving S clients at
once, the aggregate's case: each weight read once a step for all rows): phases per step, tokens/s over
all S, and GB/s of weights a step; llama.cpp's bindings decode one sequence, so its time is given for
one stream only.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import torch

import llama_build
import models
from llorch.engine.kv.pool import BLOCK_SIZE, HOST_KV_DTYPE, bytes_per_block
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.host import physical_cores
from llorch.kernels import build as kernels
from llorch.kernels.blocks import row_bytes
from llorch.weights.model_source import LoadedModel
from llorch.weights.native_loader import load_native
from speed import cpu_flags, memory_bandwidth_gb_s

PHASES = ("setup", "norm", "q k v", "rope, cache", "attention", "combine", "o", "residual",
          "gate up", "activation", "down", "head")
PROJECTIONS = {"q k v": ("q", "k", "v"), "o": ("o",), "gate up": ("gate", "up"), "down": ("down",)}
MODELS = {"default": models.default_model, "1b": models.billion_model, "3b": models.three_billion_model}


def profile_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(kernels.build_library(kernels.chosen_variant(), ("LLORCH_PROFILE",))))
    lib.llorch_decoder_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.llorch_decoder_forward.restype = ctypes.c_int
    lib.llorch_profile_take.argtypes = [ctypes.c_void_p]
    lib.llorch_profile_take.restype = None
    return lib


def take(lib: ctypes.CDLL) -> np.ndarray:
    out = np.zeros(len(PHASES), dtype=np.float64)
    lib.llorch_profile_take(out.ctypes.data)
    return out


def projection_bytes(native: object) -> dict[str, int]:
    def size(matrix: object) -> int:
        return row_bytes(matrix.type, matrix.cols) * matrix.rows  # type: ignore[attr-defined]

    sizes = {phase: sum(size(getattr(layer, name)) for layer in native.layers for name in names)  # type: ignore[attr-defined]
             for phase, names in PROJECTIONS.items()}
    sizes["head"] = size(native.head)  # type: ignore[attr-defined]
    return sizes


def ours(loaded: LoadedModel, contexts: list[int], steps: int, lib: ctypes.CDLL,
         streams: int = 1) -> dict[int, tuple[float, np.ndarray]]:
    """Per context: seconds per step and seconds per phase per step, `streams` rows a step; `loaded`'s step is
    run by the profiling build `lib`."""
    native = loaded.native
    per_stream = (max(contexts) + steps + 8) // BLOCK_SIZE + 2
    runner = ModelRunner(native, None, HOST_KV_DTYPE,
                         (per_stream * streams + 1) * bytes_per_block(loaded.config, HOST_KV_DTYPE))
    tables = [list(range(1 + s * per_stream, 1 + (s + 1) * per_stream)) for s in range(streams)]
    prompt = [i % 1000 + 100 for i in range(max(contexts))]
    results = {}

    def step(tokens: list[int], position: int) -> list[int]:
        logits = runner.forward([ChunkInput([token], position, table, True)
                                 for token, table in zip(tokens, tables, strict=True)])
        best = runner.best_of(logits)
        return list(best) if best is not None else [int(row.argmax()) for row in logits]

    for context in contexts:
        for table in tables:
            runner.forward([ChunkInput(prompt[:context], 0, table, True)])
        # each stream its own token, so that the rows differ as clients' do
        tokens = [5 + s for s in range(streams)]
        for i in range(4):  # warm
            tokens = step(tokens, context + i)
        take(lib)
        started = time.perf_counter()
        for i in range(steps):
            tokens = step(tokens, context + 4 + i)
        results[context] = ((time.perf_counter() - started) / steps, take(lib) / steps)
    return results


def llama_cpp_seconds(path: Path, contexts: list[int], steps: int, threads: int) -> dict[int, float]:
    llama_cpp = llama_build.bindings()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(contexts) + steps + 16, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = [i % 1000 + 100 for i in range(max(contexts))]
    results = {}
    for context in contexts:
        llm.reset()
        llm.eval(prompt[:context])
        for _ in range(4):
            llm.eval([5])
        started = time.perf_counter()
        for _ in range(steps):
            llm.eval([5])
        results[context] = (time.perf_counter() - started) / steps
    return results


def report(label: str, context: int, step: float, phases: np.ndarray, sizes: dict[str, int], bandwidth: float,
           theirs: float | None, streams: int = 1) -> list[str]:
    per = "token" if streams == 1 else "step"
    head = (f"### {label}, context {context}: {step * 1e3:.2f} ms per token ({1 / step:.1f} tok/s)" if streams == 1
            else f"### {label}, {streams} streams, context {context}: {step * 1e3:.2f} ms per step "
                 f"({streams / step:.1f} tok/s over all)")
    lines = [head + (f"; llama.cpp {theirs * 1e3:.2f} ms ({1 / theirs:.1f} tok/s), ours / theirs in speed "
                     f"{theirs / step:.2f}x" if theirs else ""), "",
             f"| phase | ms per {per} | share | weight MB | GB/s | of the read bandwidth |",
             "|---|---|---|---|---|---|"]
    outside = step - phases.sum()
    for name, seconds in [*zip(PHASES, phases, strict=True), ("outside the C step", outside)]:
        size = sizes.get(name, 0)
        weight = f"{size / 1e6:.1f} | {size / seconds / 1e9:.1f} | {size / seconds / 1e9 / bandwidth:.0%}" \
            if size and seconds > 0 else " | | "
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {seconds / step:.1%} | {weight} |")
    weights = sum(sizes.values())
    lines += ["", f"weights {weights / 1e6:.1f} MB per {per}: {weights / step / 1e9:.1f} GB/s over the whole step, "
              f"{weights / step / 1e9 / bandwidth:.0%} of the read bandwidth ({bandwidth:.1f} GB/s)", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1b,3b")
    parser.add_argument("--contexts", default="1,512")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--streams", default="1", help="comma-separated: streams decoding together")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    kernels.set_threads(args.threads)
    torch.set_num_threads(args.threads)  # the bandwidth probe's sum
    lib = profile_library()
    bandwidth = memory_bandwidth_gb_s()
    print(f"threads {args.threads}; read bandwidth {bandwidth:.1f} GB/s; CPU flags: {cpu_flags()}\n")
    for label in args.models.split(","):
        path = MODELS[label]()
        loaded = load_native(path)
        loaded.native.lib = lib  # the same model description, run by the profiling build
        sizes = projection_bytes(loaded.native)
        measured = {count: ours(loaded, contexts, args.steps, lib, count) for count in streams}
        del loaded  # freed before llama.cpp loads its own copy
        theirs: dict[int, float] = {}
        if not args.skip_llama and 1 in streams:
            try:
                theirs = llama_cpp_seconds(path, contexts, args.steps, args.threads)
            except Exception as exc:  # a comparator that fails is reported, the rest still prints
                print(f"llama.cpp failed: {exc}", file=sys.stderr)
        for count, by_context in measured.items():
            for context in contexts:
                step, phases = by_context[context]
                print("\n".join(report(f"{label} ({path.name})", context, step, phases, sizes, bandwidth,
                                       theirs.get(context) if count == 1 else None, count)))


if __name__ == "__main__":
    main()
