"""Speculative decoding over HTTP, beside llama-server's own speculative modes, on the same file.

    python bench/speculative.py [--threads N] [--reps 2] [--clients 8,16] [--skip-llama]

Speculation only pays where the proposals are right, so this measures the embedded default
model (a real model: random weights accept nothing) on two single-stream greedy tasks:
- grounded: the prompt holds a text and asks for it back (answering from a given text,
  editing, summarising and filling JSON repeat long runs of their context the same way);
- free: an open continuation, where little repeats.
Each runs on a llorch worker with speculation off and with its default (n-gram), and on
llama-server without speculation and with each of its n-gram modes; decode tokens/s is
(tokens - 1) / (last arrival - first arrival), median of --reps. The greedy texts with and
without speculation are compared (they must be identical). Then the aggregate tokens/s of
--clients streaming clients (concurrency.py's jobs) with llorch's speculation off and on.
`make bench` runs this as part of its one run; alone it writes bench/results/speculative-<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import concurrency
import llama_build
import streams
from launch import free_port, start_server, stop
from llorch.host import physical_cores
from llorch.weights.default_model import default_model_path

MAX_TOKENS = 160
TEXT = (
    "The town council met on Tuesday evening to review the budget for the new public library. After a long "
    "discussion, the members agreed to fund a children's reading room, an archive of local newspapers going back "
    "to 1890, and a small garden behind the building where readers can sit in the summer. The mayor thanked the "
    "volunteers who had collected more than four thousand signatures, and promised a public meeting in the spring "
    "to present the final plans. Construction is expected to begin in May and to last about eighteen months; "
    "during that time the old library on Mill Street will stay open, with shorter hours on weekends. The council "
    "also asked the architects to keep the oak trees on the north side of the lot, to add a ramp at the main "
    "entrance, and to make the meeting rooms available to clubs and schools free of charge.")
TASKS = {
    # The opening quote starts the copy: without it this base model's first token is a near-tie between
    # copying and commenting, which two engines' roundings can decide differently.
    "grounded": f"Text:\n{TEXT}\n\nThe same text, copied word for word:\n\"",
    "free": "Once upon a time, in a village at the edge of a great forest, there lived",
}
LLAMA_MODES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def llorch_stream(url: str, prompt: str) -> tuple[list[float], str]:
    return streams.llorch(url, prompt, MAX_TOKENS)


def llama_stream(url: str, prompt: str) -> tuple[list[float], str]:
    return streams.llama_server(url, prompt, MAX_TOKENS)


def single_stream(command: list[str], url: str, ready: Callable[[httpx.Response], bool],
                  stream: Callable[[str, str], tuple[list[float], str]], reps: int,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """Each task's median decode tokens/s and its greedy text, on one server."""
    server = start_server(command, url, ready, env=env)
    try:
        stream(url, "Hello")  # warm-up
        out: dict[str, Any] = {}
        for task, prompt in TASKS.items():
            runs = [stream(url, prompt) for _ in range(reps)]
            rates = [streams.decode_rate(arrivals) for arrivals, _ in runs]
            out[task] = {"decode_tok_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                         "tokens": len(runs[0][0]) - 1, "text": runs[0][1]}
            print(f"      {task}: {out[task]['decode_tok_s']:.1f} tok/s ({out[task]['tokens']} tokens)", flush=True)
        return out
    finally:
        stop(server)


def worker(args: argparse.Namespace, model: Path, port: int, speculative: str, slots: int = 1) -> list[str]:
    from launch import worker_command

    return [*worker_command(), "--model", str(model), "--port", str(port), "--threads", str(args.threads),
            "--max-running", str(slots), "--speculative", speculative, "--log-level", "warning"]


def llama_server(args: argparse.Namespace, model: Path, port: int, mode: str) -> list[str]:
    return [str(llama_build.server_binary()), "-m", str(model), "--port", str(port), "-t", str(args.threads), "-tb",
            str(args.threads), "-np", "1", "-c", "4096", "--no-webui", "--spec-type", mode]


def attempt(results: dict[str, Any], name: str, measure: Callable[[], Any]) -> None:
    print(f"    {name}", flush=True)
    try:
        results[name] = measure()
    except Exception as exc:  # a row that fails is reported; the others still run
        results[name] = {"failed": f"{type(exc).__name__}: {exc}"}
        print(f"      failed: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()


def bench(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Every row of the speculative table for `model` (see the module's docstring)."""
    single: dict[str, Any] = {}
    for mode in ("off", "ngram"):
        port = free_port()
        attempt(single, f"llorch speculative {mode}",
                lambda mode=mode, port=port: single_stream(worker(args, model, port, mode),  # type: ignore[misc]
                                                           f"http://127.0.0.1:{port}", concurrency_ready,
                                                           llorch_stream, args.reps))
    if not args.skip_llama:
        for mode in LLAMA_MODES:
            port = free_port()
            attempt(single, f"llama-server {mode}",
                    lambda mode=mode, port=port: single_stream(  # type: ignore[misc]
                        llama_server(args, model, port, mode), f"http://127.0.0.1:{port}",
                        lambda r: r.status_code == 200, llama_stream, args.reps, llama_build.library_environment()))
    aggregate: dict[str, Any] = {}
    for mode in ("off", "ngram"):
        attempt(aggregate, f"llorch speculative {mode}", lambda mode=mode: levels(args, model, mode))  # type: ignore[misc]
    return {"single": single, "aggregate": aggregate}


def concurrency_ready(response: httpx.Response) -> bool:
    return response.json().get("status") == "healthy"


def levels(args: argparse.Namespace, model: Path, mode: str) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(worker(args, model, port, mode, slots=max(args.clients)), url, concurrency_ready)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            concurrency.llorch_job(http, concurrency.prompt_for(999, 0), 8, "warm-up")
        out = {}
        for clients in args.clients:
            level = concurrency.run_level(url, concurrency.llorch_job, clients, args.jobs_per_client, 64)
            out[str(clients)] = level.tokens_per_s
            print(f"      {clients} clients: {level.tokens_per_s:.1f} tok/s", flush=True)
        return out
    finally:
        stop(server)


def report(results: dict[str, Any]) -> list[str]:
    single, aggregate = results.get("single", {}), results.get("aggregate", {})
    off = single.get("llorch speculative off", {})
    on = single.get("llorch speculative ngram", {})
    lines = ["", f"## speculative decoding: {results.get('file', 'the default model')}, greedy, {MAX_TOKENS} tokens, "
             "single stream over HTTP; decode tok/s, median of the reps; ratios to llorch without speculation and "
             "to llama-server's best mode on the task", "",
             "| server | grounded tok/s | free tok/s |", "|---|---|---|"]
    best = {task: max((v[task]["decode_tok_s"] for k, v in single.items()
                       if k.startswith("llama-server") and k != "llama-server none" and task in v), default=None)
            for task in TASKS}
    for name, figures in single.items():
        if "failed" in figures:
            lines.append(f"| {name} | failed: {figures['failed']} | |")
            continue
        cells = []
        for task in TASKS:
            rate = figures[task]["decode_tok_s"]
            cell = f"{rate:.1f}"
            if name == "llorch speculative ngram" and task in off:
                cell += f" **{rate / off[task]['decode_tok_s']:.2f}x** off"
                if best[task]:
                    cell += f", **{rate / best[task]:.2f}x** llama-server's best"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if on and off and "failed" not in on and "failed" not in off:
        same = all(on[task]["text"] == off[task]["text"] for task in TASKS)
        lines.append(f"\ngreedy text with and without speculation identical: {'yes' if same else '**no**'}")
    if aggregate:
        lines += ["", "| clients | aggregate tok/s, speculation off | on | ratio |", "|---|---|---|---|"]
        a_off, a_on = aggregate.get("llorch speculative off", {}), aggregate.get("llorch speculative ngram", {})
        for clients in a_off:
            if clients == "failed" or clients not in a_on:
                continue
            lines.append(f"| {clients} | {a_off[clients]:.1f} | {a_on[clients]:.1f} | "
                         f"**{a_on[clients] / a_off[clients]:.2f}x** |")
        for name, figures in aggregate.items():
            if "failed" in figures:
                lines.append(f"| {name} | failed: {figures['failed']} | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[8, 16])
    parser.add_argument("--jobs-per-client", type=int, default=2)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    args.threads = args.threads or physical_cores()
    model = default_model_path()
    results = {"file": model.name, "threads": args.threads, **bench(args, model)}
    print("\n".join(report(results)))
    concurrency.save(results, "speculative")


if __name__ == "__main__":
    main()
