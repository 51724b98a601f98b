"""The C allocator: giving its freed memory back to the system, and how much it has handed out."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any


def release_freed_memory() -> None:
    """Hand glibc's free pages back to the system.

    Parsing a large tokenizer.json (a 262k vocabulary) leaves ~200 MB of freed parser
    memory that glibc keeps for reuse; nothing reuses it, yet it counts as resident
    memory, and whatever is loaded next would stack on top of it. Trimming takes
    milliseconds.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> None:
    """Serve every allocation of `threshold` bytes or more from a mapping of its own, unmapped when freed.

    glibc otherwise raises this threshold to the largest block freed so far (up to 32 MB): after
    the first long prompt, the C step's per-step buffers (up to 4 MB each for a 512-token chunk of
    the default model) come from the heap, and their pages stay resident for good (measured:
    about 40 MB after one 500-token request). A fixed threshold turns that adjustment off.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy stands
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)


def heap_bytes() -> int:
    """Bytes the C allocator has handed out and not had back, all threads together (glibc's
    mallinfo2); 0 where the allocator cannot say."""
    if _mallinfo2 is None:
        return 0
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load_mallinfo2() -> Any:
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    return function


_mallinfo2 = _load_mallinfo2()
