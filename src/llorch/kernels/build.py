"""Compile the C kernels once per machine and instruction set, and load the best one with ctypes.

Why our own C instead of torch ops: decode speed is bounded by reading the weights once
per token, so the kernel that reads them must read the GGUF blocks at their own width
and run near memory bandwidth; torch has no kernel for these block types, and at decode
sizes its per-op dispatch costs more than the arithmetic (see csrc/decoder.c).

The same sources (csrc/*.c) are built as one variant per instruction set, each with
explicit flags rather than -march=native, and the best variant this CPU runs is loaded:
- amx: avx512-vnni plus AMX's int8 tiles for activation rows sixteen at a time (csrc/amx.c), and its
  bfloat16 tiles for a prompt's rows (csrc/amx_bf16.c);
- avx512-vnni: AVX-512 with VNNI's 8-bit dot products (vpdpbusd);
- avx512: AVX-512 (the integer dot uses AVX2's 16-bit pair products);
- avx2: AVX2 and FMA;
- portable: plain C, auto-vectorized for whatever the compiler targets by default
  (on Arm, NEON through -mcpu=native).
LLORCH_KERNELS=<variant> forces one (it must run on this CPU). Libraries are built with
the machine's C compiler (`CC`, default `cc`) and cached under the llorch cache
directory, keyed by the sources, the compiler and the flags; a warm start only loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llorch.cache import cache_dir
from llorch.host import cpuinfo, physical_cores

SOURCES = Path(__file__).with_name("csrc")


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine."""


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the variant needs


_X86_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_X86_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *_X86_AVX2)
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
X86_VARIANTS = (  # best first
    Variant("amx", (*_X86_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
            _AVX512_FLAGS | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
    Variant("avx512-vnni", (*_X86_AVX512, "-mavx512vnni"), _AVX512_FLAGS | {"avx512_vnni"}),
    Variant("avx512", _X86_AVX512, _AVX512_FLAGS),
    Variant("avx2", _X86_AVX2, _AVX2_FLAGS),
    Variant("portable", (), frozenset()),
)
OTHER_VARIANTS = (Variant("portable", ("-mcpu=native",) if sys.platform != "darwin" else (), frozenset()),)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache  # the CPU does not change under a process; the engine asks for the library every step
def cpu_flags() -> frozenset[str]:
    for line in cpuinfo().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_variants() -> list[Variant]:
    """Every variant this CPU can execute, best first."""
    if not _is_x86():
        return list(OTHER_VARIANTS)
    flags = cpu_flags()
    return [v for v in X86_VARIANTS if v.cpu_flags <= flags]


def chosen_variant() -> Variant:
    runnable = runnable_variants()
    forced = os.environ.get("LLORCH_KERNELS")
    if not forced:
        return runnable[0]
    for variant in runnable:
        if variant.name == forced:
            return variant
    names = ", ".join(v.name for v in runnable)
    raise KernelUnavailable(f"LLORCH_KERNELS={forced} does not run on this CPU (it runs: {names})")


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


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.c"))


def _flags(variant: Variant, defines: tuple[str, ...] = ()) -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-std=c11", *variant.flags, *(f"-D{define}" for define in defines)]
    if sys.platform != "darwin":  # Apple's clang has no OpenMP; there the kernels run on one thread
        flags.append("-fopenmp")
    return flags


def _target(variant: Variant, compiler: str, flags: list[str], sources: list[Path]) -> Path:
    """Where the library of these sources, compiler and flags is cached: a digest of all three names it."""
    digest = hashlib.sha256()
    for source in [*sources, *sorted(SOURCES.glob("*.h"))]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(_compiler_version(compiler).encode() + " ".join(flags).encode())
    return cache_dir() / "kernels" / f"llorch-{variant.name}-{digest.hexdigest()[:20]}.so"


def library_name() -> str:
    """The name of the library library() gives (built or not): what changes whenever its code does."""
    return _library_name(os.environ.get("LLORCH_KERNELS"), os.environ.get("CC"))


@functools.cache  # asked for twice a warm start (weights.weight_image): one compiler run and source digest
def _library_name(forced: str | None, compiler: str | None) -> str:
    """library_name for these values of LLORCH_KERNELS and CC, which chosen_variant and _compiler read."""
    variant = chosen_variant()
    return _target(variant, _compiler(), _flags(variant), _sources()).stem


def build_library(variant: Variant, defines: tuple[str, ...] = ()) -> Path:
    """The compiled library of `variant`, building it when the cache has none. `defines`: macros for
    builds other than the worker's (LLORCH_PROFILE, bench/step_profile.py)."""
    compiler = _compiler()
    flags = _flags(variant, defines)
    sources = _sources()
    target = _target(variant, compiler, flags, sources)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load half a file. Each
    # source compiles in a compiler process of its own, as many at once as there are cores.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        compile_flags = [flag for flag in flags if flag != "-shared"]

        def compile_one(source: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", f"{scratch}/{source.stem}.o"],
                                  capture_output=True, text=True, timeout=600)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(compile_one, sources))
        if all(result.returncode == 0 for result in results):
            objects = [f"{scratch}/{source.stem}.o" for source in sources]
            results = [subprocess.run([compiler, *flags, *objects, "-o", str(output), "-lm"],
                                      capture_output=True, text=True, timeout=600)]
        failed = next((result for result in results if result.returncode != 0), None)
        if failed is not None:
            last = (failed.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelUnavailable(f"building the C kernels ({variant.name}) failed: {last}")
        os.replace(output, target)
    return target


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "llorch_row_bytes": ([_INT, _I64], _I64),
    "llorch_dequantize_row": ([_INT, _P, _I64, _P], None),
    "llorch_quantize_rows": ([_P, _I64, _I64, _P], None),
    "llorch_matmul": ([_INT, _P, _I64, _I64, _P, _P, _I64, _P, _INT], _INT),
    "llorch_matmul_prompt": ([_INT, _P, _I64, _I64, _P, _I64, _P, _INT], _INT),
    "llorch_bf16_takes": ([_P, _INT], _INT),
    "llorch_decoder_forward": ([_P, _P, _INT], _INT),
    "llorch_fail_allocations": ([_INT], None),
    "llorch_take_chunks_taken": ([], _I64),
    "llorch_amx_ready": ([], _INT),
    "llorch_struct_layout": ([_INT, _P], _I64),
    "llorch_argmax_rows": ([_P, _I64, _I64, _P], None),
    "llorch_mask_row": ([_P, _I64, _P, _I64], None),
    "llorch_sample_row": ([_P, _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_float, ctypes.c_double], _I64),
    "llorch_sample_rows": ([_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _INT], None),
    "llorch_matrix_row": ([_INT, _P, _I64, _I64, _I64, _P], None),
    "llorch_repacked_type": ([_INT, _I64], _INT),
    "llorch_repack": ([_INT, _P, _I64, _I64], _INT),
    "llorch_read_ranges": ([_INT, _I64, _P, _P, _P, _P], _I64),
    "llorch_attend_chunk": ([_P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _I64, _I64, _P, _P, _INT], None),
    "llorch_attend_chunk_then": ([_P, _P, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _I64, _I64, _P, _P,
                                  _INT, _P], None),
    "llorch_to_fp16": ([_P, _I64, _P], None),
    "llorch_tok_new": ([_I64, _P, _P, _P, _P, _P, _I64, _P, _I64, _INT], _P),
    "llorch_tok_free": ([_P], None),
    "llorch_tok_lookup": ([_P, ctypes.c_char_p, _I64], _I64),
    "llorch_tok_encode": ([_P, ctypes.c_char_p, _I64, _P], _I64),
    "llorch_tok_decode": ([_P, _P, _I64, _INT, _P, _I64], _I64),
    "llorch_spm_merges": ([_I64, _P, _P, _P, _P, _I64, _P, _I64], _I64),
}


@functools.cache
def load_variant(name: str) -> ctypes.CDLL:
    """One variant's library (built on first use); KernelUnavailable says why not."""
    variant = next((v for v in runnable_variants() if v.name == name), None)
    if variant is None:
        raise KernelUnavailable(f"the {name} kernels do not run on this CPU")
    try:
        lib = ctypes.CDLL(str(build_library(variant)))
    except OSError as exc:
        raise KernelUnavailable(f"loading the C kernels failed: {exc}") from exc
    for function, (argtypes, restype) in _SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


_threads: int | None = None


def set_threads(count: int) -> None:
    """The worker's --threads for the C step (torch's own count is set apart, for its paths)."""
    global _threads
    _threads = count


def threads() -> int:
    """Threads the C step runs on: set_threads's count, else one per physical core, counted once (every step
    asks, and counting reads /proc/cpuinfo: about 50 us)."""
    global _threads
    if not _threads:
        _threads = physical_cores()
    return _threads


_building = threading.Lock()  # one build at a time: a caller waits for the one under way, then finds it cached


_chosen: tuple[str | None, ctypes.CDLL] | None = None  # the last answer, and the LLORCH_KERNELS it was for


def library() -> ctypes.CDLL:
    """The kernels this worker uses: the best variant for this CPU (or LLORCH_KERNELS's)."""
    global _chosen
    forced, chosen = os.environ.get("LLORCH_KERNELS"), _chosen
    if chosen is not None and chosen[0] == forced:  # asked for every engine step: no lock once chosen
        return chosen[1]
    with _building:
        lib = _library_for(forced)
    _chosen = (forced, lib)
    return lib


def in_use() -> str:
    """The variant library() gives, as the start-up log names it: with AMX, whether Linux granted this
    process the tile registers (if not, that library's VNNI kernels compute every row)."""
    name = chosen_variant().name
    if name == "amx" and not library().llorch_amx_ready():
        return "amx (tile registers refused: VNNI kernels only)"
    return name


def loaded() -> ctypes.CDLL | None:
    """The kernels library() gives, if this process has it already; None while a first start still builds it
    (or it cannot be): for work that has a slower way without it and should not wait."""
    chosen = _chosen
    return chosen[1] if chosen is not None and chosen[0] == os.environ.get("LLORCH_KERNELS") else None


def start_building() -> None:
    """Build (or find) the library on a thread of its own: a first start compiles for about 6 s, in a
    compiler process that runs beside the imports and the model's conversion. library() waits for it;
    a failure is raised there again, to the caller that decides what it means."""

    def build() -> None:
        with contextlib.suppress(KernelUnavailable):
            library()

    threading.Thread(target=build, name="llorch-kernels", daemon=True).start()


@functools.cache  # asked for on every engine step: choosing again each time cost ~10 us
def _library_for(forced: str | None) -> ctypes.CDLL:
    """The chosen library, cached by LLORCH_KERNELS's value (`forced`), which chosen_variant reads."""
    return load_variant(chosen_variant().name)
