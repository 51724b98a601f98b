"""Everything speed, memory and fidelity, beside llama.cpp and transformers, in one run.

    make bench                      # = python bench/speed.py
    LLORCH_BENCH_AVX2=1 python bench/speed.py ...   # both engines as on a CPU with AVX2 alone
    python bench/speed.py [--threads N] [--reps 3] [--models default,1b,3b] [--clients 1,8,16,32]
                          [--skip-transformers] [--skip-llama] [--skip-concurrency] [--skip-fidelity]
                          [--skip-dequantize] [--skip-speculative] [--skip-embeddings]

For each model (the embedded default model, and Llamas of 1.1 and 3 billion parameters in
Q4_K_M built on this machine, see models.py), on the same file, prompt token ids and
thread count:
- single stream, in-process: llorch's runner fed directly (the C step on the file's
  blocks; `--dequantize`'s float32 weights through torch as the old path), llama.cpp
  through its Python bindings, transformers' generate (float32);
- HTTP's share: llorch's decode over HTTP as a fraction of its decode in-process against one
  worker, in windows of 32 tokens in turn;
- single stream over HTTP: a llorch worker with default flags but speculation off, and llama.cpp's own
  `llama-server`; each restarted per repetition, with its peak resident memory (VmHWM)
  holding one slot of 4096 tokens; the first start of each is reported too, llorch's with an
  empty cache but the kernels set-up builds (the file converted), and set-up's build of the
  kernels once per run;
- start-to-ready: warm starts of the two servers in turn, START_TURNS per repetition of each
  (the goal's figure);
- concurrency: aggregate tokens/s and time to first token at 1, 8, 16 and 32 streaming
  clients against a llorch worker and llama-server with as many slots, both up at once and
  each level run against one and then the other;
- fidelity: mean KL divergence and top-token agreement against the file computed exactly
  in float32, llorch beside llama.cpp (fidelity.py).
Once, after the models: sentence embeddings with all-MiniLM-L6-v2, a llorch worker beside
llama-server and sentence-transformers (embeddings.py).
Figures: prefill tokens/s at 512 prompt tokens (= 512 / time to first token), decode
tokens/s over 128 tokens; medians over --reps with min..max; ratios are to llama.cpp.
The roofline: in-process decode (ours and llama.cpp's) as a fraction of the weights read once per
token at the read bandwidth (every matrix, but one row of a token embedding table the output
projection does not share), measured over a buffer far larger than the last-level cache; the two
engines decode in alternating windows of 16 tokens with a probe between every two, each window
held to the probes on either side of it (the machine's bandwidth drifts within seconds); decoding
after a one-token prompt (weight-bound, the goal's case) and after the 512-token one.
One llama.cpp build serves both llama.cpp rows (llama_build.py). A row that fails is
reported as failed, with its reason, and every other row still runs. Writes
bench/results/speed-<device>-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

import concurrency
import embeddings
import fidelity
import llama_build
import models
import speculative
import streams
from decoders import Decoder, context_text, windows_in_turn
from launch import free_port, llama_healthy, start_server, stop
from llorch.engine.factory import kv_dtype
from llorch.engine.kv.pool import BLOCK_SIZE, HOST_KV_DTYPE, bytes_per_block
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.engine.sequence import prompt_rows
from llorch.host import cpuinfo, physical_cores
from llorch.kernels import build as kernels
from llorch.weights.arena import WeightArena
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import LoadedModel, load_model
from llorch.weights.native_loader import load_native
from llorch.weights.weight_image import wait_for_images
from soak import rss_mb

PROMPT_TOKENS = 512
DECODE_TOKENS = 128
SERVER_CONTEXT = 4096
RESULTS = Path(__file__).parent / "results"
METRICS = ("prefill_tok_s", "decode_tok_s", "ttft_s", "start_to_ready_s", "peak_rss_mb")
# The roofline rows by the prompt decoded after: one token (weight-bound: attention reads next to nothing), and
# the bench's prompt (attention over 512 positions is then about a tenth of a step, compute and not weights).
WEIGHT_BOUND = "weight-bound decode / read bandwidth"
ROOFLINE_PROMPTS = {WEIGHT_BOUND: 1, "decode / read bandwidth": PROMPT_TOKENS}
ROOFLINE_WINDOW = 16  # decode tokens between two bandwidth probes (roofline_windows)
ROOFLINE_WINDOWS = 8  # windows per engine, prompt and repetition
SHARE_WINDOW = 32  # decode tokens per window of the HTTP share (http_share)
SHARE_WINDOWS = 8  # HTTP windows per repetition
START_TURNS = 4  # warm starts of each server per repetition, in turn (start_turns)
STARTS = "start-to-ready, warm, in turn"
HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s"}


def once_per_token(sizes: dict[str, int], rows: dict[str, int], table: str, head: str) -> int:
    """The bytes of these tensors (`sizes`, their `rows`) one decode token reads: every one once, but a token
    embedding `table` of its own (where a `head` is the output projection) gives the token one row.
    Counting that whole table (36.9 of the 1.1B file's 667 MB) put every roofline row 6% high."""
    total = sum(sizes.values())
    return total - sizes[table] + sizes[table] // rows[table] if head in sizes and table in sizes else total


def file_bytes_per_token(model: Path) -> int:
    """once_per_token of the file's own tensors: what llama.cpp reads a token."""
    tensors = GGUFFile(model).tensors
    return once_per_token({name: t.nbytes for name, t in tensors.items()},
                          {name: t.shape[0] for name, t in tensors.items()}, "token_embd.weight", "output.weight")


def bytes_per_token(loaded: LoadedModel, model: Path) -> dict[str, int]:
    """once_per_token for each engine, from its own form of the file."""
    weights = loaded.model.weights
    ours = {name: weights[name].nbytes for name in loaded.model.types}
    return {"llorch": once_per_token(ours, {name: weights[name].shape[0] for name in ours}, "embed_tokens.weight",
                                     "lm_head.weight"),
            "llama.cpp": file_bytes_per_token(model)}


def prompt_ids(loaded: LoadedModel) -> list[int]:
    """Exactly PROMPT_TOKENS ids (BOS first) of ordinary English text."""
    return loaded.tokenizer.encode(context_text())[:PROMPT_TOKENS]


STEADY = 0.1  # a window whose two probes differ by at most this share of their mean ran at that bandwidth
BAND_GB_S = 5  # the bandwidth bands of roofline_by_bandwidth


def roofline_by_bandwidth(windows: dict[str, list[tuple[float, float, float]]]) -> dict[str, dict[str, Any]]:
    """Each engine's roofline fractions by the bandwidth its windows ran at: (probe before, probe after, fraction)
    per window, in bands of BAND_GB_S GB/s, of the windows whose two probes agree within STEADY (the host's
    bandwidth held while they ran). Why: decode keeps closer to the bound when memory is slow than when it
    is fast (the kernels' arithmetic hides under slow reads), so one median over a run mixes whatever bands
    the host went through; by band, two runs or two builds compare where they overlap."""
    bands: dict[int, dict[str, list[float]]] = {}
    for name, rows in windows.items():
        for before, after, fraction in rows:
            mean = (before + after) / 2
            if abs(before - after) <= STEADY * mean:
                bands.setdefault(int(mean / 1e9 // BAND_GB_S * BAND_GB_S), {}).setdefault(name, []).append(fraction)
    return {str(band): {name: {"median": statistics.median(values), "windows": len(values)}
                        for name, values in engines.items()} for band, engines in sorted(bands.items())}


def bandwidth_table(bands: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """roofline_by_bandwidth as a table: per band, each engine's median fraction and its number of windows."""
    if not bands:
        return []
    lines = ["| read bandwidth (steady windows) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for band, engines in bands.items():
        cells = [f"{engines[name]['median']:.0%} ({engines[name]['windows']})" if name in engines else "-"
                 for name in names]
        lines.append(f"| {band}-{int(band) + BAND_GB_S} GB/s | " + " | ".join(cells) + " |")
    return lines


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


# -- in-process engines ------------------------------------------------------------------------------
def decode_runner(loaded: LoadedModel, tokens: int) -> tuple[ModelRunner, list[int]]:
    """The worker's runner for one stream of `tokens` positions (the C step on host arrays, where it runs)
    and the KV blocks that stream uses."""
    pool = (tokens // BLOCK_SIZE + 3) * bytes_per_block(loaded.config, kv_dtype(loaded))
    native = loaded.native
    runner = (ModelRunner(native, None, HOST_KV_DTYPE, pool) if native is not None
              else ModelRunner(loaded.model, torch.device("cpu"), loaded.dtype, pool))
    return runner, list(range(1, runner.kv.num_blocks))


def bench_llorch(loaded: LoadedModel, ids: list[int]) -> dict[str, float]:
    runner, blocks = decode_runner(loaded, len(ids) + DECODE_TOKENS + 1)
    prompt = prompt_rows(len(ids), runner.prompt_kernel)  # as the engine feeds a prompt
    return timed_greedy(lambda: greedy_token(runner, ChunkInput(ids, 0, blocks, True, prompt=prompt)),
                        lambda token, i: greedy_token(runner, ChunkInput([token], len(ids) + i, blocks, True)))


def greedy_token(runner: ModelRunner, chunk: ChunkInput) -> int:
    """The chunk's next token: the step's own argmax where it found one, as the engine's greedy decoding takes it."""
    logits = runner.forward([chunk])
    best = runner.best_of(logits)
    return best[0] if best is not None else int(logits[0].argmax())


def bench_llama_cpp(llama_cpp: Any, model: Path, ids: list[int], threads: int) -> dict[str, float]:
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_batch=PROMPT_TOKENS, n_ubatch=PROMPT_TOKENS,
                          n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill() -> int:
        llm.reset()
        llm.eval(ids)
        return llama_next_token(llm)

    def step(token: int, _: int) -> int:
        llm.eval([token])
        return llama_next_token(llm)

    timed_greedy(prefill, step)  # warm-up
    return timed_greedy(prefill, step)


def llama_next_token(llm: Any) -> int:
    """The argmax of the last evaluated token's logits, as ours is taken."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def bench_transformers(model: Path, ids: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32)
    prompt = torch.tensor([ids])
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


# -- servers over HTTP -------------------------------------------------------------------------------
def stream_llorch(base_url: str, prompt: str) -> list[float]:
    return streams.llorch(base_url, prompt, DECODE_TOKENS)[0]


def stream_llama_server(base_url: str, prompt: str) -> list[float]:
    return streams.llama_server(base_url, prompt, DECODE_TOKENS, ignore_eos=True)[0]


def bench_server(command: list[str], url: str, ready: Callable[[httpx.Response], bool],
                 stream: Callable[[str, str], list[float]], prompt: str, reps: int,
                 env: dict[str, str] | None = None, first_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Per-rep streamed figures, start-to-ready of each (warm) restart and its peak RSS; and the first
    start's time, under `first_env` where given (a llorch worker's with an empty cache: a user's first start)."""
    first_start = start_server(command, url, ready, env=first_env or env)  # it fills caches: not a warm start
    stop(first_start)
    runs = []
    for _ in range(reps):
        server = start_server(command, url, ready, env=env)
        try:
            stream(url, prompt)  # warm-up request
            arrivals = stream(url, prompt)
            first = arrivals[1] - arrivals[0]
            runs.append({"prefill_tok_s": PROMPT_TOKENS / first, "ttft_s": first,
                         "decode_tok_s": streams.decode_rate(arrivals),
                         "start_to_ready_s": server.start_to_ready_s,
                         "peak_rss_mb": rss_mb(server.process.pid, "VmHWM")})
        finally:
            stop(server)
    return {**summarize(runs), "first_start_s": first_start.start_to_ready_s}


def start_turns(servers: dict[str, tuple[list[str], str, Callable[[httpx.Response], bool], dict[str, str] | None]],
                turns: int) -> dict[str, dict[str, float]]:
    """Seconds from launch to ready of each server's warm start, the servers in turn: a start takes about a
    second, and this machine's speed moves within seconds, so the two sides alternate, as every comparison
    here does. `servers`: name -> (command, url, ready, environment)."""
    runs = []
    for _ in range(turns):
        run = {}
        for name, (command, url, ready, env) in servers.items():
            server = start_server(command, url, ready, env=env)
            run[name] = server.start_to_ready_s
            stop(server)
        runs.append(run)
    return summarize(runs)


def empty_cache_environment(directory: Path) -> dict[str, str]:
    """A llorch worker's environment with a cache of its own in `directory` holding only the kernels, as
    set-up leaves it (`make serve` builds them): it converts the file as on a machine's first start."""
    built = kernels.build_library(kernels.chosen_variant())  # this run's own, built for its in-process rows
    (directory / "kernels").mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, directory / "kernels" / built.name)
    return {**os.environ, "LLORCH_CACHE_DIR": str(directory)}


def kernels_setup_s() -> float:
    """Seconds set-up spends building this CPU's kernels into an empty cache (`python -m llorch.kernels`)."""
    with tempfile.TemporaryDirectory(prefix="llorch-kernels-") as empty:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llorch.kernels"], env={**os.environ, "LLORCH_CACHE_DIR": empty},
                       check=True, capture_output=True, timeout=900)
        return time.perf_counter() - started


class ReadProbe:
    """The machine's read bandwidth, one sum over a buffer far larger than the caches (memory_bandwidth_gb_s's
    buffer, allocated once): about 30 ms a probe, short enough to take between every two decode windows.
    The buffer is on the pages the worker's weights are on (its weight arena: huge pages where the OS gives
    them). Why: on 4 KB pages the sum pays a TLB miss every 4 KB and the hardware prefetchers stop at every
    page edge, so the probe read slower than decode could: measured in turn on one machine (Zen 3, two
    threads, ten sums each), 20.6 GB/s on 4 KB pages against 22.3 on huge pages, and decode windows held
    to the 4 KB probe came to 104-113% of it."""

    def __init__(self) -> None:
        arena = WeightArena(probe_bytes())
        self.buffer = torch.from_numpy(arena.take((arena.size,)).view(np.float32))
        self.buffer.fill_(1.0)

    def __call__(self) -> float:
        started = time.perf_counter()
        self.buffer.sum()
        return self.buffer.numel() * 4 / (time.perf_counter() - started)


def roofline_windows(model: Path, prompt: int, sizes: dict[str, int], llama_cpp: Any | None,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Decode's weight bytes per second over the read bandwidth probed on either side of it, each engine in a
    process of its own (decoders.py: here, after this process's other rows, ours measured a sixth slow).

    This machine's bandwidth moves by half within seconds (neighbours on the host), and decode moves
    with it: probes taken around a whole 128-token decode put it anywhere from 60% to 100% of them. So
    each engine decodes in windows of ROOFLINE_WINDOW tokens, ours and llama.cpp's in turn, a probe
    between every two windows, and each window is held to the mean of the probes on either side of it
    (a window apart: 0.15 s on the default model, about 1.3 s on the 3B); the figures are medians over
    the windows. `prompt`: the tokens decoded after (one, BOS alone: the weight-bound case, where
    attention has next to nothing to read; or the bench's prompt).
    Every window decodes from the prompt's end again, overwriting the window before, so that each one
    runs at the context its row names. Carried on from window to window instead, the weight-bound row
    ended at 385 positions (three repetitions), where the default model's attention reads 7 MB of keys
    and values a token beside its 246 MB of weights, and computes over them. Measured in one process,
    windows in turn with a probe between (Zen 5, 2 threads, the probe at 39 GB/s): our windows ran at
    0.998 of the probe from the prompt's end, 0.965 carried on."""
    engines = {"llorch": Decoder("llorch", model, args.threads, ROOFLINE_WINDOW, prompt)}
    if llama_cpp is not None:
        engines["llama.cpp"] = Decoder("llama.cpp", model, args.threads, ROOFLINE_WINDOW, prompt)
    windows = ROOFLINE_WINDOWS * args.reps
    taken = windows_in_turn(engines, windows, ReadProbe())
    steady = {name: [(before, after, rate * sizes[name] / ((before + after) / 2)) for rate, before, after in held]
              for name, held in taken.items()}
    first = next(iter(taken))
    runs = []
    for i in range(windows):  # a round: each engine's window i, and the probes around them
        probes = [taken[first][i][1], *(taken[name][i][2] for name in taken)]
        runs.append({"bandwidth_gb_s": statistics.median(probes) / 1e9, **{name: steady[name][i][2] for name in taken}})
    return {**summarize(runs), "by_bandwidth": roofline_by_bandwidth(steady)}


def http_share(command: list[str], url: str, model: Path, reps: int, threads: int) -> dict[str, Any]:
    """Decode over HTTP as a fraction of decode in-process, in short windows of each in turn against one worker.

    This machine's speed moves by a fifth within seconds (neighbours on the host), more than HTTP
    costs: whole 128-token decodes taken back to back gave pairs from 0.85 to 2 on the same build.
    So, as the roofline does, the two decode in windows of SHARE_WINDOW tokens in turn: in-process
    (a process of its own, as the roofline's) at the same positions after the bench's prompt every time, then
    a streamed request for as many tokens after its first (the worker's prefix cache holds the prompt,
    so a request computes one token of it), and each HTTP window is held to the mean of the in-process
    windows on either side of it. The figures are medians over SHARE_WINDOWS * reps HTTP windows."""
    alone = Decoder("llorch", model, threads, SHARE_WINDOW, PROMPT_TOKENS)
    server = None
    try:
        prompt = alone.ready()
        server = start_server(command, url, llorch_healthy)
        streams.llorch(url, prompt, 2)  # the prompt into the worker's prefix cache
        runs = []
        before = alone.tokens_per_s()
        for _ in range(SHARE_WINDOWS * reps):
            served = streams.decode_rate(streams.llorch(url, prompt, SHARE_WINDOW + 1)[0])
            after = alone.tokens_per_s()
            beside = (before + after) / 2
            runs.append({"ratio": served / beside, "http_decode_tok_s": served, "in_process_decode_tok_s": beside})
            before = after
        return summarize(runs)
    finally:
        if server is not None:
            stop(server)
        alone.close()


def llorch_worker_command(args: argparse.Namespace, model: Path, port: int, slots: int, context: int) -> list[str]:
    from launch import worker_command

    # Speculation off: these rows compare decoding with llama-server's (which speculates only when told to)
    # and with our in-process step; the speculative table measures it (speculative.py).
    return [*worker_command(), "--model", str(model), "--port", str(port), "--threads", str(args.threads),
            "--max-running", str(slots), "--ctx-size", str(context), "--log-level", "warning", "--speculative", "off"]


def llama_server_command(args: argparse.Namespace, model: Path, port: int, slots: int, context: int) -> list[str]:
    return [str(llama_build.server_binary()), "-m", str(model), "--port", str(port), "-t", str(args.threads), "-tb",
            str(args.threads), "-np", str(slots), "-c", str(slots * context), "-cb", "--no-webui",
            "--threads-http", str(slots + 2)]


def llorch_healthy(response: httpx.Response) -> bool:
    return response.json().get("status") == "healthy"


# -- one model -----------------------------------------------------------------------------------------
def attempt(section: dict[str, Any], name: str, measure: Callable[[], Any], into: str | None = "engines") -> None:
    """Run one row (into section[into][name]; with `into` None the row files its own results); a failure is
    recorded with its reason and the run goes on."""
    print(f"  {name}", flush=True)
    try:
        result = measure()
        if into is not None:
            section.setdefault(into, {})[name] = result
    except Exception as exc:  # a comparator that fails is reported, the other rows still run
        section.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
        print(f"    failed: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()


def bench_model(args: argparse.Namespace, label: str, model: Path, llama_cpp: Any | None) -> dict[str, Any]:
    section: dict[str, Any] = {"label": label, "file": model.name, "file_mb": round(model.stat().st_size / 1e6, 1),
                               "kernels": kernels.chosen_variant().name}
    served = load_native(model)  # as the CPU worker loads it
    wait_for_images()  # its first load writes the matrices' image: done before anything is timed
    ids = prompt_ids(served)
    prompt = served.tokenizer.decode(ids[1:])  # without BOS: both servers add it
    section["bytes_per_token"] = bytes_per_token(served, model)
    # The KV pool of the concurrency worker holds as many tokens as llama-server's slots (its
    # default budget would hold fewer of a large model's tokens, and jobs would wait for blocks).
    kv_block_bytes = bytes_per_block(served.config, kv_dtype(served))
    print(f"{label}: {model.name}", flush=True)

    def in_process(loaded: LoadedModel) -> dict[str, Any]:
        return summarize([bench_llorch(loaded, ids) for _ in range(args.reps + 1)][1:])  # the first: warm-up

    attempt(section, "llorch (in-process)", lambda: in_process(served))
    served = None  # the rows below start processes of their own: free this copy first
    for name, length in ROOFLINE_PROMPTS.items():
        attempt(section, name, lambda length=length: roofline_windows(  # type: ignore[misc]
            model, length, section["bytes_per_token"], llama_cpp, args), into="roofline")
    port = free_port()
    attempt(section, "llorch HTTP / in-process", lambda: http_share(
        llorch_worker_command(args, model, port, 1, SERVER_CONTEXT), f"http://127.0.0.1:{port}", model, args.reps,
        args.threads), into="http_share")
    if not args.skip_dequantize:
        def dense() -> dict[str, Any]:
            return in_process(load_model(model, torch.device("cpu"), torch.float32))

        attempt(section, "llorch --dequantize (in-process)", dense)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llorch-first-start-") as empty:
        attempt(section, "llorch (HTTP)", lambda: bench_server(
            [*llorch_worker_command(args, model, port, 1, SERVER_CONTEXT), "--no-prefix-cache"],
            f"http://127.0.0.1:{port}", llorch_healthy, stream_llorch, prompt, args.reps,
            first_env=empty_cache_environment(Path(empty))))
    if llama_cpp is not None:
        attempt(section, "llama.cpp (in-process)", lambda: summarize(
            [bench_llama_cpp(llama_cpp, model, ids, args.threads) for _ in range(args.reps)]))
        port = free_port()
        attempt(section, "llama.cpp (HTTP)", lambda: bench_server(
            llama_server_command(args, model, port, 1, SERVER_CONTEXT), f"http://127.0.0.1:{port}", llama_healthy,
            stream_llama_server, prompt, args.reps, env=llama_build.library_environment()))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = {"llorch": (llorch_worker_command(args, model, port, 1, SERVER_CONTEXT), url, llorch_healthy, None)}
    if llama_cpp is not None:
        servers["llama.cpp"] = (llama_server_command(args, model, port, 1, SERVER_CONTEXT), url, llama_healthy,
                                llama_build.library_environment())
    attempt(section, STARTS, lambda: start_turns(servers, START_TURNS * args.reps), into="starts")
    if not args.skip_transformers and label == "default":
        attempt(section, "transformers f32 (in-process)", lambda: summarize([bench_transformers(model, ids)]))
    if not args.skip_concurrency:
        slots = max(args.clients)
        port = free_port()
        servers = {"llorch": concurrency.Served(
            [*llorch_worker_command(args, model, port, slots, concurrency.SLOT_CONTEXT), "--kv-cache-mb",
             str(-(-(slots * concurrency.SLOT_CONTEXT // BLOCK_SIZE + 1) * kv_block_bytes // 2**20))],
            f"http://127.0.0.1:{port}", llorch_healthy, concurrency.llorch_job)}
        if llama_cpp is not None:
            port = free_port()
            servers["llama.cpp"] = concurrency.Served(
                llama_server_command(args, model, port, slots, concurrency.SLOT_CONTEXT), f"http://127.0.0.1:{port}",
                llama_healthy, concurrency.llama_job, llama_build.library_environment())

        def clients_in_turn() -> None:
            for name, entry in concurrency.bench_servers(servers, args).items():
                if isinstance(entry, str):
                    section.setdefault("failed", {})[f"{name} (concurrency)"] = entry
                else:
                    section.setdefault("concurrency", {})[name] = entry

        attempt(section, "concurrency: the servers in turn at each level", clients_in_turn, into=None)
    if not args.skip_fidelity:
        attempt(section, "kl", lambda: fidelity.measure(model, args.threads, llama_cpp), into="fidelity")
    if not args.skip_speculative and label == "default":  # a real model: random weights accept no proposal
        options = argparse.Namespace(**{**vars(args), "clients": [c for c in args.clients if c in (8, 16)] or [8],
                                        "skip_llama": llama_cpp is None})
        section["speculative"] = {"file": model.name, **speculative.bench(options, model)}
    return section


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), 0 when unknown."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def probe_bytes() -> int:
    """The read probe's buffer: at least 1 GiB and eight times the last-level cache (some CPUs of this
    kind have 480 MB of L3)."""
    return max(1 << 30, 8 * last_level_cache_bytes())


def memory_bandwidth_gb_s() -> float:
    """Read bandwidth: the best of several sums over a buffer far larger than the caches."""
    probe = ReadProbe()
    return max(probe() for _ in range(5)) / 1e9


def cpu_flags() -> str:
    for line in cpuinfo().splitlines():
        if line.startswith("flags"):
            return " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))))
    return ""


# -- report ----------------------------------------------------------------------------------------------
def ratio(mine: dict[str, Any] | None, theirs: dict[str, Any] | None, metric: str) -> float | None:
    if not mine or not theirs or metric not in mine or metric not in theirs:
        return None
    return mine[metric]["median"] / theirs[metric]["median"]


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"machine: {results['machine']['cpu']}; {results['threads']} threads; read bandwidth "
             f"{results['machine']['bandwidth_gb_s']:.1f} GB/s; CPU flags: {results['machine']['flags']}"]
    if results.get("as_avx2"):
        lines.append("both engines capped at AVX2 (LLORCH_BENCH_AVX2=1): llorch's avx2 kernels, llama.cpp built so; "
                     "a CPU with AVX2 alone, on this machine's caches and memory")
    if "llama_cpp" in results:
        lines.append(f"llama.cpp: {results['llama_cpp']}")
    setup = results.get("kernels_setup_s")
    if setup is not None:  # seconds, or why it failed
        lines.append("set-up builds the kernels (python -m llorch.kernels, empty cache): "
                     + (f"{setup:.2f} s" if isinstance(setup, float) else setup))
    for label, section in results["models"].items():
        engines = section.get("engines", {})
        lines += ["", f"## {label}: {section['file']} ({section['file_mb']} MB); prompt {PROMPT_TOKENS}, decode "
                  f"{DECODE_TOKENS}; median (min..max) of {results['reps']} reps; ratio = ours / llama.cpp", ""]
        header = ["engine", "prefill tok/s", "decode tok/s", "TTFT s", "start-to-ready s", "peak RSS MB"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name, figures in engines.items():
            reference = engines.get("llama.cpp (HTTP)" if name.endswith("(HTTP)") else "llama.cpp (in-process)")
            cells = [name]
            for metric in METRICS:
                if metric not in figures:
                    cells.append("-")
                    continue
                m = figures[metric]
                cell = f"{m['median']:.3g} ({m['min']:.3g}..{m['max']:.3g})"
                r = ratio(figures, reference, metric) if reference is not figures else None
                cells.append(cell + (f" **{r:.2f}x**" if r is not None else ""))
            lines.append("| " + " | ".join(cells) + " |")
        for name, reason in section.get("failed", {}).items():
            lines.append(f"| {name} | failed: {reason} | | | | |")
        levels = section.get("concurrency", {})
        if levels:
            lines += ["", "| clients | llorch tok/s | llama.cpp tok/s | ratio | llorch TTFT p50 / p99 s | "
                      "llama.cpp TTFT p50 / p99 s |", "|---|---|---|---|---|---|"]
            ours = levels.get("llorch", {}).get("levels", [])
            theirs = {lv["clients"]: lv for lv in levels.get("llama.cpp", {}).get("levels", [])}
            for mine in ours:
                other = theirs.get(mine["clients"])
                r = f"**{mine['tokens_per_s'] / other['tokens_per_s']:.2f}x**" if other else "-"
                other_tps = f"{other['tokens_per_s']:.1f}" if other else "-"
                other_ttft = f"{other['ttft_p50_s']:.2f} / {other['ttft_p99_s']:.2f}" if other else "-"
                lines.append(f"| {mine['clients']} | {mine['tokens_per_s']:.1f} | {other_tps} | {r} | "
                             f"{mine['ttft_p50_s']:.2f} / {mine['ttft_p99_s']:.2f} | {other_ttft} |")
        kl = section.get("fidelity", {}).get("kl")
        if kl:
            parts = [f"{name}: mean KL {f['kl_mean']:.5f}, top-1 {f['top1_agreement']:.1%}"
                     for name, f in kl.items() if isinstance(f, dict)]
            lines += ["", f"fidelity against the file computed exactly in float32, {kl['tokens']} tokens of English "
                      "text: " + "; ".join(parts)]
        if "speculative" in section:
            lines += speculative.report(section["speculative"])
        share = section.get("http_share", {}).get("llorch HTTP / in-process")
        if share:
            r, served, alone = share["ratio"], share["http_decode_tok_s"], share["in_process_decode_tok_s"]
            lines += ["", f"decode over HTTP / in-process, in windows of {SHARE_WINDOW} tokens in turn against one "
                      f"worker: {r['median']:.3f} ({r['min']:.3f}..{r['max']:.3f}) over {r['reps']} windows; median "
                      f"{served['median']:.1f} vs {alone['median']:.1f} tok/s"]
        firsts = {name: engines[name]["first_start_s"] for name in ("llorch (HTTP)", "llama.cpp (HTTP)")
                  if "first_start_s" in engines.get(name, {})}
        if firsts:
            lines += ["", "first start-to-ready of the run (llorch's with an empty cache but the kernels set-up "
                      "builds: the file converted): " + "; ".join(f"{name} {seconds:.2f} s"
                                                                   for name, seconds in firsts.items())]
        starts = section.get("starts", {}).get(STARTS)
        if starts:
            cells = [f"{name} {f['median']:.3f} s ({f['min']:.3f}..{f['max']:.3f})" for name, f in starts.items()]
            r = starts["llorch"]["median"] / starts["llama.cpp"]["median"] if "llama.cpp" in starts else None
            lines += ["", f"{STARTS} ({starts['llorch']['reps']} each): " + "; ".join(cells)
                      + (f"; **{r:.2f}x**" if r is not None else "")]
        lines += ["", *roofline(results, section)]
        lines += ["", *goals(section)]
    if "embeddings" in results:
        lines += embeddings.report(results["embeddings"])
    return lines


def roofline(results: dict[str, Any], section: dict[str, Any]) -> list[str]:
    """Decode is bound by reading the weights once per token: each engine's in-process decode as a fraction
    of that bound, against the bandwidth probed around it (roofline_windows), after each roofline prompt."""
    rows, cache = section.get("roofline", {}), results["machine"].get("llc_mb", 0)
    size = section["bytes_per_token"]["llorch"]
    if not rows:
        return []
    fits = ("the whole file fits in the last-level cache, so decode can beat this bound" if size / 1e6 <= cache
            else f"{min(cache / (size / 1e6), 1):.0%} of it fits in the {cache:.0f} MB last-level cache" if cache
            else "the last-level cache's size is unknown")
    lines = [f"roofline: {size / 1e6:.1f} MB of weights per token; each window of {ROOFLINE_WINDOW} decode tokens "
             f"against the read bandwidth probed just before and after it; medians over the windows ({fits}):"]
    for row, prompt in ROOFLINE_PROMPTS.items():
        windows = rows.get(row)
        if not windows:
            continue
        bandwidth = windows["bandwidth_gb_s"]
        lines.append(f"- decode after {prompt} prompt token{'s' if prompt > 1 else ''} (bandwidth median "
                     f"{bandwidth['median']:.1f}, {bandwidth['min']:.1f}..{bandwidth['max']:.1f} GB/s):")
        for name in ("llorch", "llama.cpp"):
            if name in windows:
                f = windows[name]
                lines.append(f"  - {name} (in-process): {f['median']:.0%} ({f['min']:.0%}..{f['max']:.0%}) of the "
                             "roofline")
        table = bandwidth_table(windows.get("by_bandwidth", {}), [n for n in ("llorch", "llama.cpp") if n in windows])
        if table:
            lines += ["", "  by the bandwidth each window ran at (median fraction, windows):", "",
                      *[f"  {line}" for line in table], ""]
    return lines


def goals(section: dict[str, Any]) -> list[str]:
    """The issue's goals, met or not, from this run's figures."""
    engines, checks = section.get("engines", {}), []

    def check(name: str, value: float | None, goal: str, met: bool | None) -> None:
        shown = f"{value:.2f}" if value is not None else "not measured"
        verdict = "met" if met else ("NOT met" if met is not None else "unknown")
        checks.append(f"- {name}: {shown} (goal {goal}): {verdict}")

    def metric(engine: str, name: str) -> float | None:
        figures = engines.get(engine, {})
        return figures[name]["median"] if name in figures else None

    share = section.get("http_share", {}).get("llorch HTTP / in-process", {}).get("ratio")
    r = share["median"] if share else None
    check("decode over HTTP / in-process (windows in turn)", r, ">= 0.95", None if r is None else r >= 0.95)
    floor = 1.4 if section.get("label") == "default" else 1.0
    r = ratio(engines.get("llorch (HTTP)"), engines.get("llama.cpp (HTTP)"), "decode_tok_s")
    check("decode over HTTP vs llama-server", r, f">= {floor}x", None if r is None else r >= floor)
    windows = section.get("roofline", {}).get(WEIGHT_BOUND, {}).get("llorch")
    r = windows["median"] if windows else None
    check("weight-bound in-process decode / roofline", r, ">= 0.95", None if r is None else r >= 0.95)
    r = ratio(engines.get("llorch (in-process)"), engines.get("llama.cpp (in-process)"), "prefill_tok_s")
    floor = 3.0 if section.get("kernels") == "amx" else 1.5  # the tile unit's own goal
    check("prefill at 512 vs llama.cpp", r, f">= {floor}x", None if r is None else r >= floor)
    levels = section.get("concurrency", {})
    ours = {lv["clients"]: lv for lv in levels.get("llorch", {}).get("levels", [])}
    theirs = {lv["clients"]: lv for lv in levels.get("llama.cpp", {}).get("levels", [])}
    for clients in (8, 16, 32):
        r = ours[clients]["tokens_per_s"] / theirs[clients]["tokens_per_s"] if clients in ours and clients in theirs \
            else None
        check(f"aggregate at {clients} clients vs llama-server", r, ">= 2x", None if r is None else r >= 2.0)
    kl = section.get("fidelity", {}).get("kl", {})
    if "llorch" in kl and "llama.cpp" in kl:
        check("KL vs llama.cpp's", kl["llorch"]["kl_mean"] / kl["llama.cpp"]["kl_mean"], "<= 0.5x",
              kl["llorch"]["kl_mean"] <= 0.5 * kl["llama.cpp"]["kl_mean"])
    starts = section.get("starts", {}).get(STARTS, {})
    r = starts["llorch"]["median"] / starts["llama.cpp"]["median"] if "llorch" in starts and "llama.cpp" in starts \
        else None
    check("start-to-ready vs llama-server (warm, in turn)", r, "<= 1.0x", None if r is None else r <= 1.0)
    r = ratio(engines.get("llorch (HTTP)"), engines.get("llama.cpp (HTTP)"), "peak_rss_mb")
    check("peak RSS vs llama-server", r, "<= 1.2x", None if r is None else r <= 1.2)
    return ["goals:", *checks]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(results["models"].items())
    figure, axes = plt.subplots(len(sections), len(METRICS) + 1, figsize=(4 * (len(METRICS) + 1), 4.2 * len(sections)),
                                squeeze=False)
    titles = {"prefill_tok_s": "prefill tok/s (512)", "decode_tok_s": "decode tok/s (128)", "ttft_s": "TTFT s",
              "start_to_ready_s": "start-to-ready s", "peak_rss_mb": "peak RSS MB"}
    for row, (label, section) in zip(axes, sections, strict=True):
        engines = section.get("engines", {})
        names = list(engines)
        colors = ["tab:blue" if n.startswith("llorch") else "tab:orange" if "llama" in n else "tab:gray" for n in names]
        for axis, metric in zip(row, METRICS, strict=False):
            spans = [engines[n].get(metric, {"median": 0, "min": 0, "max": 0}) for n in names]
            medians = [s["median"] for s in spans]
            axis.barh(range(len(names)), medians, xerr=[[s["median"] - s["min"] for s in spans],
                                                        [s["max"] - s["median"] for s in spans]], color=colors)
            axis.set_yticks(range(len(names)), names if axis is row[0] else [""] * len(names), fontsize=8)
            axis.invert_yaxis()
            axis.set_title(f"{label}: {titles[metric]}" + (" (higher better)" if metric in HIGHER_IS_BETTER
                                                           else " (lower better)"), fontsize=8)
        axis = row[-1]
        for name, color in (("llorch", "tab:blue"), ("llama.cpp", "tab:orange")):
            levels = section.get("concurrency", {}).get(name, {}).get("levels", [])
            axis.plot([lv["clients"] for lv in levels], [lv["tokens_per_s"] for lv in levels], "o-", color=color,
                      label=name)
        axis.set_xlabel("streaming clients", fontsize=8)
        axis.set_title(f"{label}: aggregate tok/s", fontsize=8)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="default,1b,3b", help="comma-separated: default, 1b, 3b")
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per job in the concurrency levels")
    parser.add_argument("--jobs-per-client", type=int, default=2)
    for skipped in ("transformers", "llama", "concurrency", "fidelity", "dequantize", "speculative", "embeddings"):
        parser.add_argument(f"--skip-{skipped}", action="store_true")
    args = parser.parse_args()
    args.threads = args.threads or physical_cores()
    if llama_build.AS_AVX2:  # llorch's side of the cap: its workers inherit it
        os.environ["LLORCH_KERNELS"] = "avx2"
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)  # the C step's own count
    results: dict[str, Any] = {"threads": args.threads, "reps": args.reps, "device": "cpu", "models": {},
                               "machine": {"cpu": next((line.split(":", 1)[1].strip() for line in cpuinfo().splitlines()
                                                        if line.startswith("model name")), "unknown"),
                                           "flags": cpu_flags(), "bandwidth_gb_s": memory_bandwidth_gb_s(),
                                           "llc_mb": last_level_cache_bytes() / 1e6},
                               "as_avx2": llama_build.AS_AVX2}
    try:
        results["kernels_setup_s"] = kernels_setup_s()
    except Exception as exc:  # reported; the rows that need the kernels say so themselves
        results["kernels_setup_s"] = f"failed: {type(exc).__name__}: {exc}"
    llama_cpp = None
    if not args.skip_llama:
        print("llama.cpp: the pinned build (built once, a few minutes)", flush=True)
        try:
            llama_cpp = llama_build.bindings()
            results["llama_cpp"] = f"{llama_build.PINNED}'s vendored source, built {llama_build.BUILD_FLAGS}"
        except Exception as exc:  # every llama.cpp row is then reported as unavailable
            results["llama_cpp"] = f"unavailable: {type(exc).__name__}: {exc}"
            print(f"  unavailable: {exc}", flush=True)
    sources = {"default": models.default_model, "1b": models.billion_model, "3b": models.three_billion_model}
    for label in args.models.split(","):
        try:
            model = sources[label]()
        except Exception as exc:
            results["models"][label] = {"file": "-", "file_mb": 0, "bytes_per_token": {},
                                        "failed": {"model": f"{type(exc).__name__}: {exc}"}}
            traceback.print_exc()
            continue
        results["models"][label] = bench_model(args, label, model, llama_cpp)
    if not args.skip_embeddings:  # one model of its own, not one per model above
        results["embeddings"] = embeddings.bench(vars(args))
    lines = report(results)
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"speed-cpu-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
