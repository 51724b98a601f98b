"""Row-wise helpers over logits on the CPU, in C: the engine's per-row work at vocabulary size."""

from __future__ import annotations

import torch
from torch import Tensor

from llorch.kernels.build import library


def argmax_rows(logits: Tensor) -> list[int]:
    """The index of each row's largest value (the first, as torch.argmax), for float32 CPU logits.

    torch's argmax over a 262k vocabulary takes 0.25 ms a row on one thread; this reads the
    row once at vector width. A row holding a NaN falls back to torch, which decides it.
    """
    logits = logits.contiguous()
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    library().llorch_argmax_rows(logits.data_ptr(), rows, cols, out.data_ptr())
    ids = out.tolist()
    return [i if i >= 0 else int(logits[r].argmax()) for r, i in enumerate(ids)]
