"""Two Ray Serve replicas against one worker: aggregate throughput under concurrent clients.

    python bench/replicas.py [--clients 1,8,16] [--max-tokens 64] [--jobs-per-client 2]

In one run, on this machine, on the default model, with the concurrency benchmark's clients and
prompts (bench/concurrency.py):
- one worker with --threads 2 (the whole machine for one engine);
- `llorch-ray-serve` with 2 CPU replicas of --threads 1 each (the machine split in two),
  on a local Ray cluster the launcher starts;
- one worker with --threads 1 (what each replica has), for scale.
A configuration that fails is reported as failed; the others still print. Peak RSS is not
reported: the replicas are Ray's processes, not the launcher's.
Writes bench/results/replicas-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx

from concurrency import bench_server, llorch_job, save
from launch import free_port


def program(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def healthy(response: httpx.Response) -> bool:
    return response.status_code == 200 and response.json().get("status") == "healthy"


def replicas_healthy(count: int) -> Callable[[httpx.Response], bool]:
    return lambda r: healthy(r) and sum(x["status"] == "healthy" for x in r.json().get("replicas", [])) == count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--jobs-per-client", type=int, default=2)
    args = parser.parse_args()
    slots = str(max(args.clients))
    quiet = ["--max-running", slots, "--log-level", "warning"]
    configurations = {
        "one worker, 2 threads": (lambda port: [program("llorch-cpu-worker"), "--port", str(port), "--threads", "2",
                                                *quiet], healthy),
        "2 replicas, 1 thread each": (lambda port: [program("llorch-ray-serve"), "--replicas", "2",
                                                    "--replica-cpus", "1", "--port", str(port), *quiet],
                                      replicas_healthy(2)),
        "one worker, 1 thread": (lambda port: [program("llorch-cpu-worker"), "--port", str(port), "--threads", "1",
                                               *quiet], healthy),
    }
    results: dict[str, object] = {"clients": args.clients, "max_tokens": args.max_tokens,
                                  "jobs_per_client": args.jobs_per_client}
    for name, (command, ready) in configurations.items():
        port = free_port()
        print(name, flush=True)
        try:
            results[name] = bench_server(name[:9], command(port), f"http://127.0.0.1:{port}", ready, llorch_job, args)
        except Exception as exc:  # a failed row is reported; the others still run
            traceback.print_exc()
            results[name] = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
    report(results)
    save(results, "replicas")


def report(results: dict[str, object]) -> None:
    names = [n for n in results if isinstance(results[n], dict)]
    print("\n| clients | " + " | ".join(f"{n} tok/s (TTFT p50 s)" for n in names) + " | replicas / one worker |")
    print("|---|" + "---|" * (len(names) + 1))
    for i, clients in enumerate(results["clients"]):  # type: ignore[arg-type]
        cells, rates = [], {}
        for name in names:
            entry = results[name]
            if "failed" in entry:  # type: ignore[operator]
                cells.append("failed")
                continue
            level = entry["levels"][i]  # type: ignore[index]
            rates[name] = level["tokens_per_s"]
            cells.append(f"{level['tokens_per_s']:.1f} ({level['ttft_p50_s']:.2f})")
        ratio = (f"{rates['2 replicas, 1 thread each'] / rates['one worker, 2 threads']:.2f}x"
                 if {"2 replicas, 1 thread each", "one worker, 2 threads"} <= rates.keys() else "-")
        print(f"| {clients} | " + " | ".join(cells) + f" | {ratio} |")
    for name in names:
        entry = results[name]
        if "failed" in entry:  # type: ignore[operator]
            print(f"{name}: FAILED {entry['failed']}")  # type: ignore[index]
        else:
            print(f"{name}: start-to-ready {entry['start_to_ready_s']:.1f} s")  # type: ignore[index]


if __name__ == "__main__":
    main()
