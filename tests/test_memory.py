"""The worker's allocator policy: a large block freed goes back to the system, whatever was freed before."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

# Blocks of 4 MB, as the C step allocates for a 512-token chunk, freed while a small object allocated
# after them stays: glibc's default would have raised its threshold after the first mapped block was
# freed, served the rest from the heap, and kept their pages behind the small object.
PROGRAM = """
import sys
import numpy as np
from llorch.memory import return_large_blocks

def resident_mb():
    return [int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS")][0]

if sys.argv[1] == "fixed":
    return_large_blocks()
np.ones(1 << 20).sum()  # one mapped block freed: glibc's cue to raise its threshold
base = resident_mb()
blocks = [np.ones(1 << 19) for _ in range(16)]  # 16 x 4 MB, touched
keep = [np.ones(64) for _ in range(100)]  # small buffers the C allocator places after them
del blocks
print(resident_mb() - base)
"""


def kept_mb(policy: str) -> int:
    result = subprocess.run([sys.executable, "-c", PROGRAM, policy], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's; /proc tells resident memory")
def test_large_blocks_freed_go_back_to_the_system() -> None:
    assert kept_mb("default") >= 32, "the scenario no longer shows glibc keeping freed blocks"
    assert kept_mb("fixed") <= 4
