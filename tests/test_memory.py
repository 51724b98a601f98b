"""The worker's memory policies: a large block freed goes back to the system, whatever was freed before; the
weights' arena is faulted in ahead of the load and holds no more than the weights."""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys

import numpy as np
import pytest

from llorch.weights.arena import arena_for, drop_prepared_arena, prepare_arena

pytestmark = pytest.mark.cpu

# A 4 MB block, as the C step allocates for a 512-token chunk, after an 8 MB mapped block was freed:
# glibc's default raises its threshold then and serves the 4 MB from the heap, whose freed pages can
# stay resident for good (behind any block allocated after them); the worker's policy maps it, and
# unmaps it when it is freed.
PROGRAM = """
import ctypes
import sys
from llorch.memory import return_large_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2

def resident_mb():
    return [int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS")][0]

if sys.argv[1] == "fixed":
    return_large_blocks()
libc.free(libc.malloc(8 << 20))  # one mapped block freed: glibc's cue to raise its threshold
mapped_before, resident_before = libc.mallinfo2().hblkhd, resident_mb()
block = libc.malloc(4 << 20)
ctypes.memset(block, 1, 4 << 20)
mapped = libc.mallinfo2().hblkhd - mapped_before >= 4 << 20
libc.free(block)
print(int(mapped), resident_mb() - resident_before)
"""


def run(policy: str) -> tuple[bool, int]:
    """Whether the 4 MB block was mapped, and the MB still resident once it was freed."""
    result = subprocess.run([sys.executable, "-c", PROGRAM, policy], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    mapped, kept = result.stdout.split()
    return mapped == "1", int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's; /proc tells resident memory")
def test_large_blocks_freed_go_back_to_the_system() -> None:
    assert run("default")[0] is False, "glibc no longer raises its threshold: the scenario shows nothing"
    mapped, kept = run("fixed")
    assert mapped
    assert kept <= 1


def resident_kb(array: np.ndarray) -> int:
    """Resident KB of the pages under `array` (mincore: per page, whatever mapping they share)."""
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    pages = -(-(array.ctypes.data + array.nbytes - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) * page // 1024


@pytest.mark.skipif(sys.platform != "linux", reason="asks Linux's mincore which pages are resident")
def test_a_prepared_arena_is_faulted_in_taken_once_and_trimmed_to_what_is_used() -> None:
    prepare_arena(64 << 20)
    arena = arena_for(40 << 20)
    assert arena.size >= 64 << 20, "the prepared arena serves a load that fits it"
    block = arena.take((40, 1 << 20))
    assert resident_kb(block) == 40 << 10, "every page of the prepared arena was faulted in"
    arena.trim()
    past = arena.take((16, 1 << 20))  # what a load never took
    assert resident_kb(past) == 0, "the pages past what was taken went back"
    assert resident_kb(block) == 40 << 10 and np.all(block == 0)
    assert arena_for(1 << 20) is not arena, "a prepared arena is handed out once"


def test_a_prepared_arena_too_small_or_dropped_is_not_used() -> None:
    prepare_arena(4 << 20)
    assert arena_for(16 << 20).size >= 16 << 20
    prepare_arena(16 << 20)
    drop_prepared_arena()
    fresh = arena_for(16 << 20)
    block = fresh.take((16, 1 << 20))
    if sys.platform == "linux":
        assert resident_kb(block) < 16 << 10, "a dropped arena is not handed out"
