"""Two builds of llorch and llama.cpp decoding in turn, in one run: a change's before and after.

    python bench/builds.py --before REV [--after TREE] [--models 1b,3b] [--windows 40] [--threads N] [--http]
                           [--context N] [--clients 8,16,32]

The machine's read bandwidth moves by half within seconds (neighbours on the host), so decode
rates taken minutes apart, or in separate runs, do not compare. Here each engine is its own
process holding its own copy of the model: llorch at commit REV (a temporary git worktree,
its kernels built from its own sources), llorch from TREE (default: this checkout, with its
uncommitted changes), and llama.cpp through its Python bindings (llama_build.py). They decode
one greedy stream after a one-token prompt (the weight-bound case), in windows of WINDOW tokens in turn,
each from the prompt's end again (as speed.py's roofline windows), a read probe (speed.py's) between
every two windows; each window is held to the mean of the probes on either side of it. Reported per
engine: the median tokens/s and the median fraction of the roofline (the file's tensor bytes a token
reads, speed.file_bytes_per_token, at the probed bandwidth). With --context N every engine first reads a
prompt of N tokens, and decodes each window at the positions after it, as after the one-token prompt:
decode at that context length, where attention reads N keys and values a layer for every token.

With --http the change is to the path from the step to the socket: both builds run as workers
and llama.cpp as llama-server (speed.py's flags), and each streams one greedy request of
HTTP_WINDOW tokens after speed.py's 512-token prompt per window (the rate after its first token, as
speed.py's HTTP rows); the after build also decodes in-process at the same positions in each
turn, in its own process, and each HTTP window is held to the mean of the in-process windows on
either side of it: HTTP's share of in-process decode, speed.py's HTTP row, for both builds.

With --clients N (or a comma-separated list, each in turn) the change is to serving many at once:
both builds run as workers and llama.cpp as llama-server, each with N slots, and in each window N
clients stream one greedy job each against one server after another (concurrency.py's jobs: a
prompt of their own, MAX_TOKENS tokens). Reported per engine: the median aggregate tokens/s over
the windows, and each build's median per-window ratio to the before build and to llama-server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import models
from decoders import Decoder, windows_in_turn
from speed import SHARE_WINDOW, ReadProbe, bandwidth_table, cpu_flags, file_bytes_per_token, roofline_by_bandwidth

WINDOW = 16  # decode tokens per window, as speed.py's roofline windows
HTTP_WINDOW = SHARE_WINDOW  # tokens per streamed request with --http, as speed.py's HTTP share
MAX_TOKENS = 64  # tokens per job with --clients, as concurrency.py's
MODELS = {"default": models.default_model, "1b": models.billion_model, "3b": models.three_billion_model}
HERE = Path(__file__).resolve().parent


def compare(label: str, trees: dict[str, Path], args: argparse.Namespace) -> list[str]:
    model = MODELS[label]()
    file_bytes = file_bytes_per_token(model)
    engines = {name: Decoder("llorch", model, args.threads, WINDOW, args.context, tree) for name, tree in trees.items()}
    engines["llama.cpp"] = Decoder("llama.cpp", model, args.threads, WINDOW, args.context)
    taken = windows_in_turn(engines, args.windows, ReadProbe())
    probes = [taken[next(iter(taken))][0][1], *(taken[name][i][2] for i in range(args.windows) for name in taken)]
    rates = {name: [rate for rate, _, _ in held] for name, held in taken.items()}
    steady = {name: [(before, after, rate * file_bytes / ((before + after) / 2)) for rate, before, after in held]
              for name, held in taken.items()}
    shares = {name: [share for _, _, share in held] for name, held in steady.items()}
    lines = [f"## {label}: {model.name}, {file_bytes / 1e6:.1f} MB of tensors a token; read bandwidth median "
             f"{statistics.median(probes) / 1e9:.1f} ({min(probes) / 1e9:.1f}..{max(probes) / 1e9:.1f}) GB/s; "
             f"{args.windows} windows of {WINDOW} tokens each"
             + (f", each after a prompt of {args.context} tokens (the roofline counts the weights alone)"
                if args.context > 1 else ""), "", "| engine | decode tok/s | of the roofline |",
             "|---|---|---|"]
    for name in engines:
        lines.append(f"| {name} | {statistics.median(rates[name]):.1f} ({min(rates[name]):.1f}.."
                     f"{max(rates[name]):.1f}) | {statistics.median(shares[name]):.0%} |")
    table = bandwidth_table(roofline_by_bandwidth(steady), list(engines))
    return [*lines, "", "of the roofline by the bandwidth each window ran at (median fraction, windows):", "", *table] \
        if table else lines


def compare_http(label: str, trees: dict[str, Path], args: argparse.Namespace) -> list[str]:
    import llama_build
    import streams
    from launch import free_port, llama_healthy, start_server, stop
    from speed import (
        PROMPT_TOKENS,
        SERVER_CONTEXT,
        llama_server_command,
        llorch_healthy,
        llorch_worker_command,
    )

    model = MODELS[label]()
    alone = Decoder("llorch", model, args.threads, HTTP_WINDOW, PROMPT_TOKENS, trees["after"])
    decode_alone = alone.tokens_per_s
    servers: dict[str, Any] = {}
    try:
        prompt = alone.ready()
        for name, tree in trees.items():
            port = free_port()
            environment = {**os.environ, "PYTHONPATH": str(tree / "src")}
            command = llorch_worker_command(args, model, port, 1, SERVER_CONTEXT)
            servers[name] = start_server(command, f"http://127.0.0.1:{port}", llorch_healthy, env=environment)
            streams.llorch(servers[name].base_url, prompt, 2)  # the prompt into the worker's prefix cache
        port = free_port()
        servers["llama-server"] = start_server(llama_server_command(args, model, port, 1, SERVER_CONTEXT),
                                               f"http://127.0.0.1:{port}", llama_healthy,
                                               env=llama_build.library_environment())
        rates: dict[str, list[float]] = {name: [] for name in servers}
        shares: dict[str, list[float]] = {name: [] for name in trees}
        before = decode_alone()
        inprocess = [before]
        for _ in range(args.windows):
            for name, server in servers.items():
                if name == "llama-server":
                    rate = streams.decode_rate(streams.llama_server(server.base_url, prompt, HTTP_WINDOW + 1, True)[0])
                else:
                    rate = streams.decode_rate(streams.llorch(server.base_url, prompt, HTTP_WINDOW + 1)[0])
                after = decode_alone()
                inprocess.append(after)
                rates[name].append(rate)
                if name in shares:
                    shares[name].append(rate / ((before + after) / 2))
                before = after
    finally:
        for server in servers.values():
            stop(server)
        alone.close()
    lines = [f"## {label}: {model.name}, over HTTP after a {PROMPT_TOKENS}-token prompt; {args.windows} windows of "
             f"{HTTP_WINDOW} tokens each; in-process decode (after) {statistics.median(inprocess):.1f} tok/s", "",
             "| engine | decode over HTTP, tok/s | of in-process decode |", "|---|---|---|"]
    for name, values in rates.items():
        share = f"{statistics.median(shares[name]):.3f}" if name in shares else ""
        lines.append(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f}) | {share} |")
    return lines


def compare_clients(label: str, trees: dict[str, Path], args: argparse.Namespace) -> list[str]:
    return [line for clients in args.clients for line in serve_clients(label, trees, args, clients)]


def serve_clients(label: str, trees: dict[str, Path], args: argparse.Namespace, clients: int) -> list[str]:
    import concurrency
    import llama_build
    from launch import free_port, llama_healthy, start_server, stop
    from speed import llama_server_command, llorch_healthy, llorch_worker_command

    model = MODELS[label]()
    jobs = {name: concurrency.llorch_job for name in trees} | {"llama-server": concurrency.llama_job}
    servers: dict[str, Any] = {}
    try:
        for name, tree in trees.items():
            port = free_port()
            command = llorch_worker_command(args, model, port, clients, concurrency.SLOT_CONTEXT)
            servers[name] = start_server(command, f"http://127.0.0.1:{port}", llorch_healthy,
                                         env={**os.environ, "PYTHONPATH": str(tree / "src")})
        port = free_port()
        command = llama_server_command(args, model, port, clients, concurrency.SLOT_CONTEXT)
        servers["llama-server"] = start_server(command, f"http://127.0.0.1:{port}", llama_healthy,
                                               env=llama_build.library_environment())
        for name, server in servers.items():  # first-request costs excluded
            concurrency.run_level(server.base_url, jobs[name], 1, 1, 8)
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.windows):
            for name, server in servers.items():
                level = concurrency.run_level(server.base_url, jobs[name], clients, 1, MAX_TOKENS)
                rates[name].append(level.tokens_per_s)
    finally:
        for server in servers.values():
            stop(server)
    before = next(iter(trees))
    lines = ["", f"## {label}: {model.name}, {clients} clients at once, one job of {MAX_TOKENS} tokens each a window; "
             f"{args.windows} windows", "",
             f"| engine | aggregate tok/s | per window, to {before} | per window, to llama-server |",
             "|---|---|---|---|"]
    for name, values in rates.items():
        ratios = [f"{statistics.median(a / b for a, b in zip(values, rates[other], strict=True)):.3f}x"
                  if name in trees and name != other else "" for other in (before, "llama-server")]
        lines.append(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f}) | "
                     f"{ratios[0]} | {ratios[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the commit measured as before (a temporary worktree)")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="the tree measured as after")
    parser.add_argument("--models", default="1b,3b")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--http", action="store_true", help="the builds as workers, llama.cpp as llama-server")
    parser.add_argument("--context", type=int, default=1, help="decode after a prompt of this many tokens")
    parser.add_argument("--clients", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="the builds as workers serving this many clients at once (comma-separated: each)")
    args = parser.parse_args()
    if args.threads is None:
        from llorch.host import physical_cores

        args.threads = physical_cores()
    if not args.before:
        parser.error("--before REV is required")
    with tempfile.TemporaryDirectory(prefix="llorch-before-") as scratch:
        before = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(HERE.parent), "worktree", "add", "--detach", "-q", str(before), args.before],
                       check=True)
        try:
            print(f"threads {args.threads}; CPU flags: {cpu_flags()}", flush=True)
            for label in args.models.split(","):
                trees = {f"before ({args.before})": before, "after": args.after.resolve()}
                way = compare_clients if args.clients else compare_http if args.http else compare
                try:
                    lines = way(label, trees, args)
                except Exception as exc:  # a model that fails is reported, the next still runs
                    lines = [f"{label}: failed: {type(exc).__name__}: {exc}"]
                print("\n".join(["", *lines]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(before)], check=False)


if __name__ == "__main__":
    main()
