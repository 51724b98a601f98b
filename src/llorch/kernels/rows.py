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


def sample_row(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float, uniform: float
               ) -> int | None:
    """One token drawn from a float32 CPU row of logits: softmax(logits / temperature) after
    top_k, top_p and min_p, the first token in vocabulary order whose cumulative probability
    passes `uniform`. None for a row holding a NaN or an infinity, which the caller decides.
    """
    row = logits.contiguous()  # held while C reads it: a temporary's memory would be freed first
    token = library().llorch_sample_row(row.data_ptr(), row.numel(), temperature, top_k, top_p, min_p, uniform)
    return None if token < 0 else int(token)


def mask_rows(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Set logits[rows[j], t] to -inf wherever bit t of bitmask[j] is clear (in place).

    Bit t of a mask is bit t % 32 of its int32 word t // 32 (llguidance's layout); ids past
    the mask are disallowed. In C for float32 CPU logits (torch's unpacking takes about
    1 ms a row at 262k tokens), with torch elsewhere.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        bitmask = bitmask.contiguous()
        lib = library()
        for j, r in enumerate(rows):
            lib.llorch_mask_row(logits[r].data_ptr(), logits.shape[1], bitmask[j].data_ptr(), bitmask.shape[1])
        return
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1).to(logits.device)
    cols = min(logits.shape[1], allowed.shape[1])
    index = torch.tensor(rows, device=logits.device)
    selected = logits[index]
    selected[:, :cols].masked_fill_(~allowed[:, :cols], float("-inf"))
    selected[:, cols:] = float("-inf")
    logits[index] = selected
