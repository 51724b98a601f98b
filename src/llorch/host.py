"""The host machine as this process sees it: its CPU's description and the cores it may use.

Kept apart from the device layer, which imports torch, so that what reads the machine
(the kernels' build, thread counts, the benchmark) costs no torch import.
"""

from __future__ import annotations

import os


def cpuinfo() -> str:
    """/proc/cpuinfo, or nothing off Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return handle.read()
    except OSError:  # not Linux
        return ""


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads share a core's
    units, so a thread per core is what matmul-bound work wants)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo().split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        if "processor" in fields and int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields.get("core id", fields["processor"])))
    return len(cores) or len(allowed) or 1
