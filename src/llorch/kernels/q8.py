"""Int8 block-quantized matrices ("q8"): int8 values [n, k] and a float32 scale per 32 values.

Every GGUF block type the worker loads becomes this one form on the CPU: Q8_0, Q4_0
and Q5_0 exactly (their blocks are 32 values times one scale), the others by
requantizing each 32-value block (error at most half a step of max|block|/127, far
below the 4-6 bit error already in those types). One form means one fast kernel.

- up to DOT_MAX_ROWS activation rows (decoding): the C kernel reads each int8 weight
  once and widens it in registers; activations stay float32;
- more rows (prompt chunks): the matrix is dequantized on the fly and a float GEMM
  runs, which is faster there; the conversion costs a few percent of the GEMM itself.
Activations are never quantized, so the accuracy cost is the weights' alone, and the
two paths differ only by float summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llorch.kernels.build import library

QBLOCK = 32
DOT_MAX_ROWS = 16


def quantize_blocks(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 values, float32 scales) of a float matrix whose rows are whole 32-value blocks."""
    rows, cols = weight.shape
    if cols % QBLOCK:
        raise ValueError(f"rows of {cols} values are not whole {QBLOCK}-value blocks")
    blocks = weight.float().reshape(rows, cols // QBLOCK, QBLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    values = torch.round(blocks * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
    return values.reshape(rows, cols), scales.contiguous()


def _ptr(tensor: Tensor) -> int:
    return tensor.data_ptr()


def dequantize(values: Tensor, scales: Tensor) -> Tensor:
    rows, cols = values.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    library().llorch_q8_dequantize(_ptr(values), _ptr(scales), rows, cols, _ptr(out), torch.get_num_threads())
    return out


def gather_rows(values: Tensor, scales: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` as float32 (the embedding lookup). Ids must be in range: the caller checks them."""
    ids = ids.to(torch.int64).contiguous()
    cols = values.shape[1]
    out = torch.empty(ids.numel(), cols, dtype=torch.float32)
    library().llorch_q8_gather(_ptr(values), _ptr(scales), cols, _ptr(ids), ids.numel(), _ptr(out))
    return out


def matmul(x: Tensor, values: Tensor, scales: Tensor) -> Tensor:
    """x [m, k] @ W.T for the quantized W [n, k], in float32."""
    x = x.float().contiguous()
    rows, cols = x.shape
    if rows > DOT_MAX_ROWS:
        return F.linear(x, dequantize(values, scales))
    out = torch.empty(rows, values.shape[0], dtype=torch.float32)
    library().llorch_q8_matmul(_ptr(x), rows, _ptr(values), _ptr(scales), values.shape[0], cols, _ptr(out),
                               torch.get_num_threads())
    return out

