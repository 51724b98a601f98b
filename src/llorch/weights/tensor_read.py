"""Tensors' bytes read from their file into their places in memory, on a thread of their own.

A warm start parses the tokenizer for most of a second, holding Python's lock all along,
and reads the weights for about as long (mostly faulting in fresh huge pages). The read is
one call of the C reader (csrc/fileread.c), which ctypes makes without Python's lock, so
the two run side by side on two cores. A loop of Python reads would stall after its first
tensor until the parse ended.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llorch.errors import ModelFileError
from llorch.kernels.build import library


class TensorRead:
    def __init__(self, path: Path, names: Sequence[str], offsets: Sequence[int],
                 targets: Sequence[np.ndarray]) -> None:
        """Starts reading each target's size in bytes from its offset in `path` into it."""
        self._path, self._names = path, list(names)
        self._targets = list(targets)  # held until the read ends: the thread writes into them
        count = len(self._targets)
        self._offsets = (ctypes.c_int64 * count)(*offsets)
        self._sizes = (ctypes.c_int64 * count)(*(t.nbytes for t in self._targets))
        self._addresses = (ctypes.c_void_p * count)(*(t.ctypes.data for t in self._targets))
        self._error = ctypes.c_int(0)
        self._failed = -1
        self._read = library().llorch_read_ranges  # resolved here: the thread only makes the call
        self._fd = os.open(path, os.O_RDONLY)
        self._thread = threading.Thread(target=self._run, name="llorch-weights-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._failed = int(self._read(self._fd, len(self._targets), self._offsets, self._sizes, self._addresses,
                                          ctypes.byref(self._error)))
        finally:
            os.close(self._fd)

    def wait(self) -> None:
        """Returns once every tensor is in place; ModelFileError names the first that could not be read."""
        self._thread.join()
        if self._failed < 0:
            return
        name, size = self._names[self._failed], self._targets[self._failed].nbytes
        if self._error.value:
            raise ModelFileError(self._path, f"reading tensor {name} failed: {os.strerror(self._error.value)}")
        raise ModelFileError(self._path, f"corrupt GGUF: tensor {name} ends before its {size} bytes")
