"""The C step's matrices as one file beside the converted model, mapped at a warm start instead of read.

A start that reads the matrices into fresh memory (weights.arena) spends most of its time faulting
that memory in: on a virtual machine whose idle memory went back to its host, 1.4 s for the 1.1B
file's 667 MB, against 0.07 s when the host still backs it. A file this machine wrote before is in
its page cache, which is not given back, and Linux maps a file's large folios (ext4 has them) on
2 MB pages, as the arena is: so a warm start maps the image in milliseconds and decodes from it as
fast. Where the mapping comes out on small pages (checked in smaps), the image is copied into an
arena instead: one read, still without the GGUF file's un-permuting and interleaving.

`<entry>/weights-<kernels>.bin` holds the matrices as the kernels read them, each 64-byte aligned;
`weights-<kernels>.json` gives each one's name, offset, shape and layout. `<kernels>` names the
kernel library (its variant and source digest): an image is never read by code that interleaves
rows differently. The image is written once, after a load that read the GGUF file, by a thread of
the lowest priority, into an unnamed file linked in when complete: a worker stopped midway leaves
nothing behind. Workers serving the same file on one machine share the image's pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llorch.kernels.blocks import file_type
from llorch.weights.arena import HUGE_PAGE, WeightArena, arena_for

log = logging.getLogger("llorch.weights")

IMAGE_VERSION = 1
ALIGN = 64  # as the arena aligns rows: whole cache lines
MADV_POPULATE_READ = 22  # Linux 5.14: fault the page tables in without touching each page
# Below this share of 2 MB mappings the image is read in again, and if it stays below, copied into an arena:
# at 87% the default model decoded 7% slower than from an arena (alternated windows, Zen 4).
HUGE_SHARE = 0.95
WRITE_CHUNK = 1 << 30  # os.write leaves Python's lock for each call; Linux writes at most ~2 GB a call
SPARE_DISK = 1 << 30  # the image is not written when it would leave less free space than this
AT_FDCWD, AT_SYMLINK_FOLLOW = -100, 0x400


@dataclass(frozen=True)
class Matrices:
    entries: dict[str, np.ndarray]  # our name -> uint8 rows [rows, row_bytes]
    layouts: dict[str, int]  # our name -> its layout (a GGUF type, or its interleaved form)


class WeightImage:
    def __init__(self, directory: Path, kernels: str) -> None:
        self.data = directory / f"weights-{kernels}.bin"
        self.index = directory / f"weights-{kernels}.json"

    @classmethod
    def beside(cls, directory: Path) -> WeightImage | None:
        """The image for this worker's kernels in a conversion entry; None where images are not kept
        (no unnamed files to write them safely, or no kernels to key them by)."""
        if not hasattr(os, "O_TMPFILE"):
            return None
        from llorch.kernels.build import KernelUnavailable, library_name

        try:
            return cls(directory, library_name())
        except KernelUnavailable:
            return None

    def exists(self) -> bool:
        return self.index.is_file() and self.data.is_file()

    def map(self, shapes: Mapping[str, tuple[int, int]], qtypes: Mapping[str, int]) -> Matrices | None:
        """The matrices of `shapes` (our names; `qtypes` their GGUF types) from the image, or None when
        there is none or it does not describe exactly these (a damaged one is logged and ignored)."""
        if not self.exists():
            return None
        try:
            with self.data.open("rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                placed = self._placed(json.loads(self.index.read_text(encoding="utf-8")), size, shapes, qtypes)
                view = _mapped(handle.fileno(), size)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a weight image that does not fit the model", extra={
                "path": str(self.data), "reason": repr(exc)})
            return None
        entries = {name: view[offset : offset + rows * width].reshape(rows, width)
                   for name, (offset, (rows, width), _) in placed.items()}
        return Matrices(entries, {name: layout for name, (_, _, layout) in placed.items()})

    @staticmethod
    def _placed(index: dict, size: int, shapes: Mapping[str, tuple[int, int]],
                qtypes: Mapping[str, int]) -> dict[str, tuple[int, tuple[int, int], int]]:
        """Each matrix's (offset, shape, layout), checked against the file's size and the model; ValueError
        names what does not fit."""
        if index["version"] != IMAGE_VERSION or index["size"] != size:
            raise ValueError(f"index for {index['size']} bytes (version {index['version']}), file of {size}")
        placed = {}
        for entry in index["entries"]:
            name, offset, layout = str(entry["name"]), int(entry["offset"]), int(entry["layout"])
            shape = (int(entry["shape"][0]), int(entry["shape"][1]))
            if shapes.get(name) != shape or file_type(layout) != qtypes[name]:
                raise ValueError(f"{name}: {shape}, layout {layout}; the model has {shapes.get(name)}")
            if offset % ALIGN or offset < 0 or offset + shape[0] * shape[1] > size:
                raise ValueError(f"{name}: offset {offset} out of place")
            placed[name] = (offset, shape, layout)
        if placed.keys() != shapes.keys():
            raise ValueError(f"{len(placed)} matrices for the model's {len(shapes)}")
        return placed

    def write_later(self, matrices: Matrices, arena: WeightArena) -> None:
        """Write the image of `matrices` (views into `arena`) on a thread of the lowest priority."""
        writer = threading.Thread(target=self._write, args=(matrices, arena), name="llorch-weight-image", daemon=True)
        with _writers_lock:
            _writers[:] = [*(w for w in _writers if w.is_alive()), writer]
        writer.start()

    def _write(self, matrices: Matrices, arena: WeightArena) -> None:
        with contextlib.suppress(OSError):  # Linux: a thread's own niceness; the load has finished with the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        base, used = arena.region()
        entries = [{"name": name, "offset": array.ctypes.data - base, "shape": list(array.shape),
                    "layout": matrices.layouts[name]} for name, array in matrices.entries.items()]
        index = {"version": IMAGE_VERSION, "size": len(used), "entries": entries}
        directory = self.data.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)  # a first start writes its conversion's entry later
            free = os.statvfs(directory)
            if free.f_bavail * free.f_frsize < len(used) + SPARE_DISK:
                log.info("not writing a weight image: the disk is nearly full", extra={"path": str(directory)})
                return
            _write_linked(directory, self.data, lambda fd: _write_all(fd, used))
            _write_linked(directory, self.index, lambda fd: _write_all(fd, json.dumps(index).encode()))
            for stale in directory.glob("weights-*"):  # another kernel build's image: never read again
                if stale not in (self.data, self.index):
                    stale.unlink(missing_ok=True)
        except OSError as exc:  # a read-only or full cache costs start-up time, never the worker
            log.warning("cannot write the weight image", extra={"path": str(self.data), "reason": str(exc)})


_writers_lock = threading.Lock()
_writers: list[threading.Thread] = []


def wait_for_images() -> None:
    """Return once every image this process began writing is written (or given up)."""
    with _writers_lock:
        writers = list(_writers)
    for writer in writers:
        writer.join()


def _mapped(fd: int, size: int) -> np.ndarray:
    """The whole file mapped read-only, its page tables filled, on 2 MB pages; else copied into an arena
    (small pages would cost the decode a TLB miss and a prefetch stop every 4 KB)."""
    view = _populated(fd, size)
    share = huge_share(view) if size >= HUGE_PAGE else 1.0
    if share >= HUGE_SHARE:
        return view
    # Part of the file's page cache is in small folios (82-91% on 2 MB pages seen, after memory pressure).
    # Dropped from the page cache and faulted in again through a huge-page mapping, it comes back in 2 MB
    # folios (99.7%), in a disk read: 0.5 s for 667 MB, against an arena's copy of it.
    del view  # unmapped: what the mapping held is no longer this worker's
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # pages other workers map stay, theirs and small
    view = _populated(fd, size)
    again = huge_share(view)
    log.info("weight image read in again for 2 MB pages", extra={"huge_share_before": round(share, 3),
                                                                  "huge_share": round(again, 3)})
    if again >= HUGE_SHARE:
        return view
    del view
    arena = arena_for(size)
    copy = arena.take((size,))
    arena.trim()
    with open(fd, "rb", buffering=0, closefd=False) as raw:  # readinto leaves Python's lock while it reads
        raw.seek(0)
        done = 0
        while done < size:
            got = raw.readinto(memoryview(copy)[done:])
            if not got:
                raise ValueError("the weight image ended early")
            done += got
    return copy


def _populated(fd: int, size: int) -> np.ndarray:
    """The file mapped read-only, asking for huge pages, with its page tables filled in."""
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with contextlib.suppress(OSError):
        region.madvise(mmap.MADV_HUGEPAGE)  # also what makes a read-back of the file come in 2 MB folios
    view = np.frombuffer(region, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), MADV_POPULATE_READ)  # a hint
    return view


def huge_share(view: np.ndarray) -> float:
    """Which share of the file mapping `view` starts is mapped on 2 MB pages (from /proc/self/smaps)."""
    start = f"{view.ctypes.data:x}-"
    lines = iter(Path("/proc/self/smaps").read_text().splitlines())
    for line in lines:
        if line.startswith(start):
            for field in lines:
                if field.startswith("FilePmdMapped:"):
                    return int(field.split()[1]) * 1024 / max(1, view.nbytes)
            break
    return 0.0


def _write_all(fd: int, data: np.ndarray | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_CHUNK]):]


def _write_linked(directory: Path, target: Path, write: object) -> None:
    """Write an unnamed file in `directory` and give it `target`'s name once complete."""
    fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o644)
    try:
        write(fd)  # type: ignore[operator]
        temporary = directory / f".{target.name}.{os.getpid()}.tmp"
        temporary.unlink(missing_ok=True)
        # linkat with AT_SYMLINK_FOLLOW, as open(2) shows for O_TMPFILE (os.link calls link(), which
        # links the /proc entry itself and fails across file systems).
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD, bytes(temporary), AT_SYMLINK_FOLLOW):
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), str(temporary))
    finally:
        os.close(fd)
    os.replace(temporary, target)
