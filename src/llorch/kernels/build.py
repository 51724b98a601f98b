"""Compile the C kernels once per machine and load them with ctypes.

Why our own C instead of a torch op: torch's CPU int8 weight-only matmul needs bf16
activations and runs far below memory bandwidth on AVX2, and its int8 GEMM is slower
than float32. Decode speed is bounded by reading the weights once per token, so the
kernel that reads them must run at bandwidth (see cpu_kernels.c).

The library is built with the machine's C compiler (`CC`, default `cc`) for this CPU
(-march=native) and cached under the llorch cache directory, keyed by the source,
the compiler, the flags and the CPU; a warm start only loads it. No torch headers are
involved, so a cold build takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llorch.cache import cache_dir
from llorch.device import cpuinfo

SOURCE = Path(__file__).with_name("cpu_kernels.c")


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine."""


def _compiler_flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-std=c11"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")
    elif sys.platform != "darwin":
        flags.append("-mcpu=native")
    if sys.platform != "darwin":  # Apple's clang has no OpenMP; there the kernels run on one thread
        flags.append("-fopenmp")
    return flags


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    lines = {line for line in cpuinfo().splitlines() if line.startswith(("model name", "flags", "Features"))}
    return "\n".join(sorted(lines)) or platform.processor() + platform.machine()


def _compiler() -> str:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler ({compiler!r} is not on PATH; set CC)")
    return compiler


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {compiler!r} does not run: {exc}") from exc


def build_library() -> Path:
    """The compiled library for this machine, building it when the cache has none."""
    compiler = _compiler()
    flags = _compiler_flags()
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), _compiler_version(compiler).encode(), " ".join(flags).encode(),
                    _cpu_identity().encode()])
    ).hexdigest()[:20]
    target = cache_dir() / "kernels" / f"cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(output), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelUnavailable(f"building the C kernels failed: {last}")
        os.replace(output, target)
    return target


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "llorch_q8_matmul": [_P, _I64, _P, _P, _I64, _I64, _P, _INT],
    "llorch_q8_gather": [_P, _P, _I64, _P, _I64, _P],
    "llorch_q8_dequantize": [_P, _P, _I64, _I64, _P, _INT],
    "llorch_rms_norm": [_P, _I64, _I64, _P, ctypes.c_float, _P],
}


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels (built on first use); KernelUnavailable says why not."""
    import torch  # noqa: F401  -- torch's OpenMP runtime must be loaded first so the kernels share it

    path = build_library()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"loading the C kernels failed: {exc}") from exc
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = None
    return lib
