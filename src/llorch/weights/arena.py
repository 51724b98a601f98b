"""One block of anonymous memory for a model's GGUF matrices, backed by huge pages where the OS allows.

The decode kernels stream every weight once per token; on 4 KB pages that costs a TLB
miss every 4 KB and stops the hardware prefetchers at each page edge. Measured on the
default model's 178 MB vocabulary projection (2 threads): 8.2 ms per token on 4 KB
pages against 5.5 ms on 2 MB pages. Linux gives huge pages to anonymous memory that
asks for them (MADV_HUGEPAGE) but not to a file's page cache, so the matrices are read
from the file once at load into one region that asks (weights.tensor_read).
They are read, not copied from a mapping, so the file's pages never count as the
worker's memory: resident memory holds each weight once.

Faulting fresh huge pages in is most of that read: 0.15 s per 256 MB, and 0.6 s on a
virtual machine whose idle memory went back to its host. So the CPU worker prepares the
arena (`prepare_arena`) as soon as it knows the file, on a thread that faults every page
in without Python's lock while the program imports; the load takes it (`arena_for`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

HUGE_PAGE = 2 << 20
POPULATE_BYTES_PER_THREAD = 256 << 20
POPULATE_CHUNK = 32 << 20  # ~20-60 ms of faulting


class WeightArena:
    def __init__(self, total_bytes: int, populate: bool = False, cancelled: threading.Event | None = None) -> None:
        """With `populate`, every page is faulted in now (call it off the main thread: it takes a while),
        unless `cancelled` is set meanwhile (the arena is then not to be used)."""
        size = max(HUGE_PAGE, -(-total_bytes // HUGE_PAGE) * HUGE_PAGE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: ask; elsewhere (or when refused) plain pages serve
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._used = 0
        if populate:
            self._populate(cancelled or threading.Event())

    @property
    def size(self) -> int:
        return len(self._bytes)

    def _populate(self, cancelled: threading.Event) -> None:
        # Through ctypes, so Python's lock is free meanwhile (mmap.madvise keeps it). A host faults pages in
        # for each CPU at once: past what one thread faults while the program imports (~256 MB), more
        # threads share the rest (the 1.1B file's 667 MB: 1.5 s on one thread, 0.7 s on two).
        address, size = self._bytes.ctypes.data, len(self._bytes)
        parts = max(1, min(os.cpu_count() or 1, size // POPULATE_BYTES_PER_THREAD))
        step = -(-size // parts // HUGE_PAGE) * HUGE_PAGE

        def fault(start: int, end: int) -> None:
            for chunk in range(start, end, POPULATE_CHUNK):  # a cancel stops it within one chunk
                if cancelled.is_set():
                    return
                ctypes.memset(address + chunk, 0, min(POPULATE_CHUNK, end - chunk))

        helpers = [threading.Thread(target=fault, args=(start, min(start + step, size)),
                                    name="llorch-arena-fault", daemon=True) for start in range(step, size, step)]
        for helper in helpers:
            helper.start()
        fault(0, min(step, size))
        for helper in helpers:
            helper.join()

    def trim(self) -> None:
        """Give back the pages past what take() handed out (a prepared arena is sized by the whole file)."""
        start = -(-self._used // mmap.PAGESIZE) * mmap.PAGESIZE
        if start < len(self._bytes) and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_DONTNEED, start, len(self._bytes) - start)

    def region(self) -> tuple[int, np.ndarray]:
        """Where the arena starts in memory, and the bytes take() handed out so far."""
        return self._bytes.ctypes.data, self._bytes[: self._used]

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """A fresh uint8 array of `shape` in the arena."""
        start = -(-self._used // 64) * 64  # rows start 64-byte aligned: whole cache lines
        size = int(np.prod(shape))
        if start + size > len(self._bytes):
            raise ValueError("the weight arena is full")
        view = self._bytes[start : start + size]
        self._used = start + size
        return view.reshape(shape)


def arena_bytes(sizes: list[int]) -> int:
    """What an arena needs for arrays of these sizes, each 64-byte aligned."""
    return sum(-(-size // 64) * 64 for size in sizes)


@dataclass(frozen=True)
class _Prepared:
    thread: threading.Thread
    arena: list[WeightArena]  # the arena once built (empty when there was no memory for it)
    cancelled: threading.Event


_prepared_lock = threading.Lock()
_prepared: list[_Prepared] = []  # at most one, until taken or dropped


def prepare_arena(total_bytes: int) -> None:
    """Start faulting in an arena of at least `total_bytes` on a thread of its own, for arena_for to hand out."""
    cancelled = threading.Event()

    def build(into: list[WeightArena]) -> None:
        with contextlib.suppress(OSError, ValueError):  # no memory for it now: the load allocates its own
            into.append(WeightArena(total_bytes, populate=True, cancelled=cancelled))

    holder: list[WeightArena] = []
    thread = threading.Thread(target=build, args=(holder,), name="llorch-arena", daemon=True)
    thread.start()
    with _prepared_lock:
        _prepared[:] = [_Prepared(thread, holder, cancelled)]


def arena_for(total_bytes: int) -> WeightArena:
    """The prepared arena when one is large enough (waiting for it to be faulted in), else a new one."""
    with _prepared_lock:
        taken = _prepared.pop() if _prepared else None
    if taken is not None:
        taken.thread.join()
        if taken.arena and taken.arena[0].size >= total_bytes:
            return taken.arena[0]
    return WeightArena(total_bytes)


def drop_prepared_arena() -> None:
    """Forget a prepared arena nothing took (the model loaded another way): its thread stops faulting
    within a chunk, and its memory goes back once that thread ends."""
    with _prepared_lock:
        for prepared in _prepared:
            prepared.cancelled.set()
        _prepared.clear()
