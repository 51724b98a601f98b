"""Backends -> devices, the start-up verification, and the residency guard.

Each worker program is hard-wired to one backend. A backend that is missing is a
one-line error and exit code 2: there is no fallback to another device.

A device is named as torch names it ("cpu", "cuda:0"). The CPU backend needs no torch: its
C step computes on numpy arrays, so torch is imported only by the backends and compute paths
that use it (torch_device).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llorch.errors import BackendUnavailable, StartupError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Backend:
    name: str
    device: str  # "cpu" or "cuda:N"


def torch_device(device: str | torch.device) -> torch.device:
    """torch's device for a compute path that uses torch, with torch's threads set to the worker's count."""
    import torch

    from llorch.kernels.build import threads

    torch.set_num_threads(threads())
    return torch.device(device)


class ResidencyError(RuntimeError):
    """A tensor that must live on the worker's device lives somewhere else."""


def resolve_backend(name: str, cuda_index: int = 0) -> Backend:
    """The device of a backend, or BackendUnavailable saying in one line why there is none."""
    if name == "cpu":
        return Backend("cpu", "cpu")
    import torch

    if name == "cuda":
        if not torch.backends.cuda.is_built():
            raise BackendUnavailable("cuda backend unavailable: this torch build has no CUDA support")
        if not torch.cuda.is_available():
            raise BackendUnavailable("cuda backend unavailable: no CUDA GPU is visible to this process")
        count = torch.cuda.device_count()
        if not 0 <= cuda_index < count:
            raise BackendUnavailable(
                f"cuda backend unavailable: --cuda-device {cuda_index} is out of range ({count} GPU(s) visible)"
            )
        return Backend("cuda", f"cuda:{cuda_index}")
    if name == "accelerate":
        if sys.platform != "darwin":
            raise BackendUnavailable(
                f"accelerate backend unavailable: Apple Accelerate needs macOS, this is {sys.platform}"
            )
        if not torch_uses_accelerate():
            raise BackendUnavailable("accelerate backend unavailable: this torch is not linked to Apple Accelerate")
        return Backend("accelerate", "cpu")
    raise ValueError(f"unknown backend {name!r}")


def torch_uses_accelerate() -> bool:
    """True when torch's build configuration names Accelerate as its BLAS."""
    import torch

    for part in torch.__config__.show().replace("\n", ",").split(","):
        if "BLAS_INFO" in part:
            return "accelerate" in part.lower()
    return False


def verify_device(device: str | torch.device) -> None:
    """Prove the device computes: a small matmul whose exact result we know (numpy's on the CPU)."""
    try:
        if str(device) == "cpu":
            result = (np.arange(12, dtype=np.float32).reshape(3, 4) @ np.ones((4, 2), dtype=np.float32)).tolist()
        else:
            import torch

            a = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
            result = (a @ torch.ones(4, 2, dtype=torch.float32, device=device)).cpu().tolist()
    except Exception as exc:  # any failure here means the device is unusable
        raise StartupError(f"device {device} failed its start-up check: {exc}") from exc
    if result != [[6.0, 6.0], [22.0, 22.0], [38.0, 38.0]]:
        raise StartupError(f"device {device} failed its start-up check: wrong matmul result {result}")


def same_device(tensor_device: torch.device, device: torch.device) -> bool:
    if tensor_device.type != device.type:
        return False
    if device.type == "cuda":
        return tensor_device.index == (device.index if device.index is not None else 0)
    return True


def assert_resident(device: torch.device, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fail loudly when any named tensor is not on `device`."""
    strays = [f"{name} on {t.device}" for name, t in tensors if not same_device(t.device, device)]
    if strays:
        shown = ", ".join(strays[:5]) + (f" and {len(strays) - 5} more" if len(strays) > 5 else "")
        raise ResidencyError(f"tensors not on the worker's device {device}: {shown}")


def assert_module_resident(device: torch.device, module: nn.Module) -> None:
    assert_resident(device, [*module.named_parameters(), *module.named_buffers()])


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def resident_module_bytes(device: torch.device, module: nn.Module) -> int:
    """The bytes a module's weights hold, after proving every one of them is on `device`."""
    assert_module_resident(device, module)
    return tensor_bytes([*module.parameters(), *module.buffers()])
