"""The worker's allocator policy: a large block freed goes back to the system, whatever was freed before."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
