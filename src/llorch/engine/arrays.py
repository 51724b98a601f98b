"""Small arrays made on a torch device or, with no device, as numpy arrays in host memory.

A sampler keeps its history beside the logits it reads: on the device for torch logits,
in numpy for the C step's. Made here, torch is imported only when a device is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    Array = Tensor | np.ndarray


def ids(values: Sequence[int], device: torch.device | None) -> Array:
    """int64 values."""
    if device is None:
        return np.array(values, dtype=np.int64)
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


def floats(values: Sequence[float], device: torch.device | None) -> Array:
    """float32 values."""
    if device is None:
        return np.array(values, dtype=np.float32)
    import torch

    return torch.tensor(values, dtype=torch.float32, device=device)


def zeros(size: int, device: torch.device | None) -> Array:
    """`size` float32 zeros."""
    if device is None:
        return np.zeros(size, dtype=np.float32)
    import torch

    return torch.zeros(size, device=device)


def concat(parts: Sequence[Array]) -> Array:
    """Arrays of one kind joined along their first axis."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(list(parts))


def grown(values: Array, count: int, capacity: int) -> Array:
    """An int64 buffer of `capacity` of the same kind as `values` (and on its device), holding values[:count] first."""
    if isinstance(values, np.ndarray):
        buffer = np.empty(capacity, dtype=np.int64)
    else:
        import torch

        buffer = torch.empty(capacity, dtype=torch.long, device=values.device)
    buffer[:count] = values[:count]
    return buffer
