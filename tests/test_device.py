"""Backends are hard-wired: a missing one exits 2 with its reason; tensors stay on the device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from llorch import host
from llorch.device import (
    ResidencyError,
    assert_module_resident,
    assert_resident,
    resolve_backend,
    verify_device,
)
from llorch.engine.config import resolve_dtype
from llorch.engine.runner import ModelRunner
from llorch.errors import BackendUnavailable
from llorch.weights.loader import LoadedModel


def run_program(program: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / program
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.cpu
def test_cpu_backend_is_always_available_and_verified() -> None:
    backend = resolve_backend("cpu")
    assert backend.device == "cpu"
    verify_device(backend.device)


@pytest.mark.cpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the cuda worker would start")
def test_cuda_worker_exits_2_with_one_line_reason_without_a_gpu() -> None:
    result = run_program("llorch-cuda-worker")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("llorch-cuda-worker: error: cuda backend unavailable:")
    assert "Traceback" not in result.stderr


@pytest.mark.cpu
@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the accelerate worker may start")
def test_accelerate_worker_exits_2_off_macos() -> None:
    result = run_program("llorch-accelerate-worker")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"llorch-accelerate-worker: error: accelerate backend unavailable: "
        f"Apple Accelerate needs macOS, this is {sys.platform}"
    )


@pytest.mark.cpu
def test_cuda_index_out_of_range_is_refused() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(BackendUnavailable, match="cuda backend unavailable"):
        resolve_backend("cuda", cuda_index=count + 3)


@pytest.mark.cpu
def test_residency_guard_catches_a_tensor_on_another_device() -> None:
    cpu = torch.device("cpu")
    assert_resident(cpu, [("ok", torch.zeros(2))])
    with pytest.raises(ResidencyError, match="stray on meta"):
        assert_resident(cpu, [("ok", torch.zeros(2)), ("stray", torch.empty(2, device="meta"))])


@pytest.mark.cpu
def test_residency_guard_checks_every_parameter_and_buffer() -> None:
    module = nn.Linear(4, 4)
    module.register_buffer("scale", torch.ones(1, device="meta"))
    with pytest.raises(ResidencyError, match="scale on meta"):
        assert_module_resident(torch.device("cpu"), module)


@pytest.mark.cpu
def test_runner_refuses_a_model_with_a_stray_weight(ours: LoadedModel) -> None:
    stray = ours.model.layers[3].mlp.down_proj
    original = stray.weight
    stray.weight = nn.Parameter(torch.empty(original.shape, device="meta"), requires_grad=False)
    try:
        with pytest.raises(ResidencyError, match=r"layers\.3\.mlp\.down_proj\.weight on meta"):
            ModelRunner(ours.model, torch.device("cpu"), torch.float32, kv_cache_bytes=2**20)
    finally:
        stray.weight = original


@pytest.mark.cuda
def test_cuda_worker_device_computes() -> None:
    backend = resolve_backend("cuda")
    verify_device(backend.device)
    assert backend.device == "cuda:0"


@pytest.mark.accelerate
def test_accelerate_backend_uses_accelerate_blas() -> None:
    backend = resolve_backend("accelerate")
    verify_device(backend.device)


HYPERTHREADED = "\n\n".join(
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 4}\nflags\t\t: fpu avx2 fma{extra}"
    for cpu in range(8) for extra in [" avx512f avx512_bf16"]
)


@pytest.mark.cpu
def test_threads_default_to_physical_cores_not_hyperthreads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "cpuinfo", lambda: HYPERTHREADED)
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    assert host.physical_cores() == 4
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda _: {0, 4}, raising=False)  # one core's two threads
    assert host.physical_cores() == 1


@pytest.mark.cpu
def test_auto_dtype_is_float32_on_every_cpu_whatever_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(host, "cpuinfo", lambda: HYPERTHREADED)  # avx512_bf16 present
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(host, "cpuinfo", lambda: HYPERTHREADED.replace(" avx512f avx512_bf16", ""))
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16  # an explicit choice is kept
