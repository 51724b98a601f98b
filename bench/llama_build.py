"""llama.cpp for the benchmarks: one build, from the pinned source, serving every llama.cpp row.

PyPI's llama-cpp-python source distribution vendors llama.cpp; it is built once on this
machine (native CPU flags, shared libraries) and cached; on a CPU with AMX without it (NO_AMX).
That one build gives:
- `llama-server`, llama.cpp's own HTTP server (parallel slots, continuous batching);
- `llama-quantize`, to make the Q4_K_M benchmark model;
- the shared libraries that llama-cpp-python's Python bindings load for the in-process
  rows (taken from the same source distribution and pointed at this build through
  LLAMA_CPP_LIB_PATH, so no second build is made by pip);
- `convert_hf_to_gguf.py` and its gguf-py, to turn a Hugging Face model into GGUF.
No network is used beyond the package index.

    python bench/llama_build.py        # build (or find) it and print where it is
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from llorch.kernels.build import cpu_flags

PINNED = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("LLORCH_BENCH_CACHE", Path.home() / ".cache" / "llorch-bench"))
# On CPUs with AMX, the native build's AMX code faults (seen on a Xeon of this machine kind): there it is
# built without AMX, for the rest of its native flags, and the report says so.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# LLORCH_BENCH_AVX2=1 (speed.py --as-avx2): built as for a CPU with AVX2 alone (Zen 3, say), whatever this
# one has, so that the AVX2 paths of both engines can be compared on any machine.
AVX2_ONLY = "-mno-avx512f -mno-avxvnni"


WITHOUT_AMX = any(flag.startswith("amx") for flag in cpu_flags())
AS_AVX2 = os.environ.get("LLORCH_BENCH_AVX2") == "1"
_FLAGS = " ".join(([NO_AMX] if WITHOUT_AMX else []) + ([AVX2_ONLY] if AS_AVX2 else []))
HOME = CACHE / (PINNED.replace("==", "-") + ("-no-amx" if WITHOUT_AMX else "") + ("-avx2" if AS_AVX2 else ""))
BUILD_FLAGS = ("native" + (f", without AMX ({NO_AMX}: its AMX code faults on this CPU)" if WITHOUT_AMX else "")
               + (f", capped at AVX2 ({AVX2_ONLY})" if AS_AVX2 else ""))
TARGETS = ("llama-server", "llama-quantize", "llama")


def ensure_build(log: Path | None = None) -> Path:
    """The directory holding the build (bin/, lib/, python/, converter/), building it on first use."""
    if (HOME / "ready").exists():
        return HOME
    if HOME.exists():
        shutil.rmtree(HOME)
    staging = HOME.with_name(HOME.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    out = log.open("a") if log else subprocess.DEVNULL
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        package = _source(work, out)
        source = package / "vendor" / "llama.cpp"
        build = work / "build"
        # GCC keeps an explicit -mno-* over -march=native wherever it stands on the command line.
        amx = [f"-DCMAKE_C_FLAGS={_FLAGS}", f"-DCMAKE_CXX_FLAGS={_FLAGS}"] if _FLAGS else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=ON", *amx], check=True, stdout=out, stderr=out)
        subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=out, stderr=out)
        (staging / "bin").mkdir()
        (staging / "lib").mkdir()
        for name in ("llama-server", "llama-quantize"):
            shutil.copy2(next(build.rglob(name)), staging / "bin" / name)
        for library in build.rglob("*.so*"):
            shutil.copy2(library, staging / "lib" / library.name, follow_symlinks=True)
        shutil.copytree(package / "llama_cpp", staging / "python" / "llama_cpp")
        _copy_converter(source, staging / "converter")
    (staging / "ready").write_text(PINNED)
    staging.replace(HOME)
    return HOME


def converter() -> Path:
    """llama.cpp's converter from the pinned source (the build's, or fetched alone: the tests convert models
    with it and need no build of llama.cpp)."""
    if (HOME / "ready").exists():
        return HOME / "converter"
    alone = HOME.with_name(HOME.name + "-converter")
    if (alone / "ready").exists():
        return alone
    shutil.rmtree(alone, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "converter"
        _copy_converter(_source(Path(tmp), subprocess.DEVNULL) / "vendor" / "llama.cpp", staging)
        (staging / "ready").write_text(PINNED)
        alone.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, alone)
    return alone


def _source(work: Path, out: Any) -> Path:
    """The pinned llama-cpp-python source package, downloaded and unpacked into `work`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                    PINNED], check=True, stdout=out, stderr=out)
    with tarfile.open(next(work.glob("llama_cpp_python-*.tar.gz"))) as archive:
        archive.extractall(work, filter="data")
    return next(p for p in work.glob("llama_cpp_python-*") if p.is_dir())


def _copy_converter(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    shutil.copy2(source / "convert_hf_to_gguf.py", target)
    for extra in ("gguf-py", "conversion"):
        if (source / extra).exists():
            shutil.copytree(source / extra, target / extra)


def server_binary() -> Path:
    return ensure_build() / "bin" / "llama-server"


def quantize_binary() -> Path:
    return ensure_build() / "bin" / "llama-quantize"


def library_environment() -> dict[str, str]:
    """Environment for running the build's binaries: its shared libraries on the loader's path."""
    lib = str(ensure_build() / "lib")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def preload_libraries(lib: Path) -> None:
    """Load ggml's shared libraries into this process, each before the ones that need it.

    The libraries' RUNPATH points into the build tree, which is deleted once they are copied
    here, and a running process cannot extend its own LD_LIBRARY_PATH: loaded first (globally,
    from the files named by their sonames), each is found by its soname when libllama, which
    the bindings load themselves, asks for it. Each library is loaded once: two copies of one
    library in a process free their globals twice at exit.
    """
    pending = sorted(path for path in lib.glob("libggml*.so.*") if path.suffixes[-1][1:].isdigit()
                     and len(path.suffixes) == 2)
    while pending:
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            raise OSError(f"cannot load {', '.join(p.name for p in failed)} from {lib}")
        pending = failed


def bindings() -> ModuleType:
    """llama-cpp-python's Python package, loading this build's libllama."""
    home = ensure_build()
    preload_libraries(home / "lib")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(home / "lib")
    if str(home / "python") not in sys.path:
        sys.path.insert(0, str(home / "python"))
    import llama_cpp

    return llama_cpp


def convert_hf_to_gguf(directory: Path, output: Path, outtype: str = "f16", tool: Path | None = None) -> None:
    """llama.cpp's own converter from the pinned source, with its own gguf-py; `tool`: a directory holding both
    (an unpacked source's llama.cpp), else the cached converter."""
    tool = tool or converter()
    environment = {**os.environ, "PYTHONPATH": f"{tool / 'gguf-py'}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, str(tool / "convert_hf_to_gguf.py"), str(directory), "--outfile", str(output),
                    "--outtype", outtype], check=True, env=environment, stdout=subprocess.DEVNULL)


def quantize(source: Path, output: Path, kind: str = "Q4_K_M") -> None:
    subprocess.run([str(quantize_binary()), str(source), str(output), kind], check=True,
                   env=library_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    print(ensure_build())
