"""Python side of the block kernels: GGUF-typed weight rows, read at the file's own width.

A weight matrix is a uint8 tensor [rows, row_bytes] holding the file's blocks as they
are; its GGUF type says how to read them (csrc/blocks.c). These functions are what the
torch path and the tests use; the decoder's own C step calls the kernels directly.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from llorch.kernels.build import library
from llorch.kernels.rows import address

if TYPE_CHECKING:
    from torch import Tensor

ACT_BLOCK_BYTES = 44  # one quantized activation block: float scale, scale times sum, two int16 sums, 32 int8 values
ACT_BLOCK = 32

# The GGUF types the kernels read in place (every other type is refused when the file loads).
NATIVE_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
# Our own layouts (csrc/repack.c): file type + REPACKED is that type with every eight rows
# interleaved, the same bytes in another order.
REPACKED = 1000


def file_type(qtype: int) -> GGMLQuantizationType:
    """The GGUF type a weight's bytes come from (an interleaved layout keeps its file type's blocks)."""
    return GGMLQuantizationType(qtype - REPACKED if qtype > REPACKED else qtype)


def repacked(weight: Tensor | np.ndarray, qtype: int, k: int, lib: ctypes.CDLL | None = None) -> int:
    """Rearrange `weight` (contiguous uint8 rows, torch or numpy) in place into the layout this CPU's
    kernels read fastest; its new type.

    Where the kernels have AVX2, Q8_0, Q5_0, Q4_K and Q6_K matrices of whole 8-row groups are
    interleaved (one 8-bit dot instruction, or AVX2's pair product, then serves eight rows); every
    other matrix stays as the file has it.
    """
    lib = lib or library()
    layout = int(lib.llorch_repacked_type(int(qtype), weight.shape[0]))
    if layout != int(qtype) and lib.llorch_repack(layout, address(weight), weight.shape[0], k) != 0:
        raise MemoryError(f"repacking a matrix of {weight.shape[0]} rows: no memory for its row groups' copies")
    return layout


def row_bytes(qtype: int, k: int) -> int:
    return int(library().llorch_row_bytes(int(qtype), k))


def quantize_activations(x: Tensor, lib: ctypes.CDLL | None = None) -> Tensor:
    """x [m, k] as the kernels quantize it, dequantized again (float32): what the integer dot multiplies."""
    import torch

    x = x.float().contiguous()
    m, k = x.shape
    raw = torch.empty(m * k // ACT_BLOCK * ACT_BLOCK_BYTES, dtype=torch.uint8)
    (lib or library()).llorch_quantize_rows(x.data_ptr(), m, k, raw.data_ptr())
    blocks = raw.view(m * k // ACT_BLOCK, ACT_BLOCK_BYTES)
    scales = blocks[:, :4].contiguous().view(torch.float32)
    values = blocks[:, 12:].contiguous().view(torch.int8).float()
    return (values * scales).reshape(m, k)


def dequantize_rows(weight: Tensor, qtype: int, k: int, ids: Tensor | None = None,
                    lib: ctypes.CDLL | None = None) -> Tensor:
    """Rows `ids` (every row when None) of a GGUF-typed matrix as float32 [len(ids), k].

    Ids must be in range: the caller checks them (the kernel reads raw memory). `lib` picks
    a kernel variant (build.load_variant); the default is the one this worker uses.
    """
    import torch

    lib = lib or library()
    rows = range(weight.shape[0]) if ids is None else ids.tolist()
    out = torch.empty(len(rows), k, dtype=torch.float32)
    for i, row in enumerate(rows):
        lib.llorch_matrix_row(int(qtype), weight.data_ptr(), weight.shape[0], k, row, out[i].data_ptr())
    return out


def matmul(x: Tensor, weight: Tensor, qtype: int, lib: ctypes.CDLL | None = None, threads: int | None = None) -> Tensor:
    """x [m, k] (float32) @ W.T for the GGUF-typed W [n, row_bytes], in float32 (block types
    quantize x to int8 blocks of 32 first, see csrc/matmul.c), on `threads` (default: torch's)."""
    import torch

    x = x.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(m * k // ACT_BLOCK * ACT_BLOCK_BYTES, dtype=torch.uint8)
    if (lib or library()).llorch_matmul(int(qtype), weight.data_ptr(), n, k, x.data_ptr(), scratch.data_ptr(), m,
                                        out.data_ptr(), threads or torch.get_num_threads()) != 0:
        raise MemoryError(f"the C matmul could not allocate its scratch for rows of {k} values")
    return out


def prompt_matmul(x: Tensor, weight: Tensor, qtype: int, lib: ctypes.CDLL | None = None) -> Tensor | None:
    """matmul's product as the C step computes a prompt's rows (csrc/amx_bf16.c: weights and activations as
    bfloat16, float32 sums); None where that kernel does not take the matrix (no AMX-BF16, a file type)."""
    import torch

    x = x.float().contiguous()
    m, k = x.shape
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    status = (lib or library()).llorch_matmul_prompt(int(qtype), weight.data_ptr(), weight.shape[0], k, x.data_ptr(),
                                                     m, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError(f"the C matmul could not allocate its buffers for {m} rows of {k} values")
    return None if status == -2 else out
