"""Row-wise helpers over logits on the CPU, in C: the engine's per-row work at vocabulary size.

Each takes a torch tensor or a numpy array: the C code reads the same float32 memory either
way, so both give the same bits. This module imports torch only where a tensor came in (so
torch is loaded already): a worker whose logits are numpy must not pay torch's start-up for
it. (Loading the kernels themselves still imports torch, in build, for its OpenMP runtime.)
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from llorch.kernels.build import library, threads

if TYPE_CHECKING:
    from torch import Tensor

    Array = Tensor | np.ndarray


def address(array: Array) -> int:
    """Where a contiguous array's first element lies in memory."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data_ptr()


def _row_stride(array: Array) -> int:
    """Bytes from one row of a 2-d array to the next."""
    return array.strides[0] if isinstance(array, np.ndarray) else array.stride(0) * array.element_size()


def _contiguous(array: Array) -> Array:
    """A C-contiguous view (or copy) the C code can read; numpy float32 only, as the functions here ask."""
    if isinstance(array, np.ndarray):
        if array.dtype != np.float32:
            raise TypeError(f"float32 logits expected, not {array.dtype}")
        return np.ascontiguousarray(array)
    return array.contiguous()


def argmax_rows(logits: Array) -> list[int]:
    """The index of each row's largest value (the first, as torch.argmax), for float32 CPU logits.

    torch's argmax over a 262k vocabulary takes 0.25 ms a row on one thread; this reads the
    row once at vector width. A row holding a NaN is decided by the array's own argmax, which
    for torch and numpy alike gives the first NaN's index.
    """
    logits = _contiguous(logits)
    rows, cols = logits.shape
    out = (ctypes.c_int64 * rows)()  # not numpy's: its set-up is most of this call's Python, every token
    library().llorch_argmax_rows(address(logits), rows, cols, ctypes.addressof(out))
    best = list(out)
    return best if min(best, default=0) >= 0 else [i if i >= 0 else int(logits[r].argmax()) for r, i in enumerate(best)]


def sample_row(logits: Array, temperature: float, top_k: int, top_p: float, min_p: float, uniform: float
               ) -> int | None:
    """One token drawn from a float32 CPU row of logits: softmax(logits / temperature) after
    top_k, top_p and min_p, the first token in vocabulary order whose cumulative probability
    passes `uniform`. None for a row holding a NaN or an infinity, which the caller decides.
    """
    row = _contiguous(logits)  # held while C reads it: a temporary's memory would be freed first
    count = row.size if isinstance(row, np.ndarray) else row.numel()
    token = library().llorch_sample_row(address(row), count, temperature, top_k, top_p, min_p, uniform)
    return None if token < 0 else int(token)


def sample_rows(logits: Array, rows: list[int], settings: list[tuple[float, int, float, float, float]]
                ) -> list[int | None]:
    """sample_row for rows of a 2-d float32 CPU array at once, shared by the C step's threads: row
    rows[i] drawn with settings[i] (temperature, top_k, top_p, min_p, uniform); None where
    sample_row gives None."""
    logits = _contiguous(logits)
    count = len(rows)
    temperature, top_k, top_p, min_p, uniform = zip(*settings, strict=True)
    # Held in names while C reads them: an array made inside the call's arguments would be freed first.
    arrays = ((ctypes.c_int64 * count)(*rows), (ctypes.c_float * count)(*temperature),
              (ctypes.c_int64 * count)(*top_k), (ctypes.c_float * count)(*top_p), (ctypes.c_float * count)(*min_p),
              (ctypes.c_double * count)(*uniform), (ctypes.c_int64 * count)())
    at = [ctypes.addressof(array) for array in arrays]
    library().llorch_sample_rows(address(logits), logits.shape[1], at[0], count, *at[1:], threads())
    return [None if token < 0 else int(token) for token in arrays[-1]]


def mask_rows(logits: Array, rows: list[int], bitmask: Array) -> None:
    """Set logits[rows[j], t] to -inf wherever bit t of bitmask[j] is clear (in place).

    Bit t of a mask is bit t % 32 of its int32 word t // 32 (llguidance's layout); ids past
    the mask are disallowed. In C for float32 CPU logits (torch's unpacking takes about
    1 ms a row at 262k tokens), unpacked by the array library elsewhere. The bitmask may be
    a numpy or a torch int32 array whatever the logits are.
    """
    host = isinstance(logits, np.ndarray)
    if host:
        in_c = logits.dtype == np.float32 and logits.flags.c_contiguous and logits.flags.writeable
    else:
        import torch

        in_c = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
    if in_c:
        bitmask = np.ascontiguousarray(bitmask if isinstance(bitmask, np.ndarray) else bitmask.numpy(force=True),
                                       dtype=np.int32)
        lib, base, stride, cols = library(), address(logits), _row_stride(logits), logits.shape[1]
        for j, r in enumerate(rows):
            lib.llorch_mask_row(base + r * stride, cols, bitmask.ctypes.data + j * bitmask.strides[0],
                                bitmask.shape[1])
        return
    if host:
        bitmask = bitmask if isinstance(bitmask, np.ndarray) else bitmask.numpy(force=True)
        allowed = ((bitmask[..., None] >> np.arange(32, dtype=np.int32)) & 1).astype(bool).reshape(len(rows), -1)
        cols = min(logits.shape[1], allowed.shape[1])
        selected = logits[rows]
        selected[:, :cols][~allowed[:, :cols]] = -np.inf
        selected[:, cols:] = -np.inf
        logits[rows] = selected
        return
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(bitmask)
    with torch.inference_mode():  # a forward pass's logits are inference tensors: written in place only here
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1).to(logits.device)
        cols = min(logits.shape[1], allowed.shape[1])
        index = torch.tensor(rows, device=logits.device)
        selected = logits[index]
        selected[:, :cols].masked_fill_(~allowed[:, :cols], float("-inf"))
        selected[:, cols:] = float("-inf")
        logits[index] = selected
