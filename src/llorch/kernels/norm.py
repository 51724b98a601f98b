"""RMSNorm in one C call, for the CPU decode path (see cpu_kernels.c)."""

from __future__ import annotations

import torch
from torch import Tensor

from llorch.kernels.build import library


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension of a float32 x, with a float32 weight."""
    x = x.contiguous()
    out = torch.empty_like(x)
    library().llorch_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps,
                              out.data_ptr())
    return out
