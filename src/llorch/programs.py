"""The worker programs' entry points (pyproject's scripts): each pauses Python's collector before the
worker's imports begin (collector.py), which is why they live outside workers.py."""

from __future__ import annotations

import sys

from llorch.collector import pause_collection


def _run(backend: str) -> None:
    pause_collection()
    from llorch.workers import run_worker

    sys.exit(run_worker(backend))


def cpu_main() -> None:
    _run("cpu")


def cuda_main() -> None:
    _run("cuda")


def accelerate_main() -> None:
    _run("accelerate")
