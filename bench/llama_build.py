"""llama.cpp's own HTTP server (`llama-server`), built once on this machine for the benchmarks.

llama-cpp-python's Python server answers one request at a time; llama.cpp's C++
server has parallel slots with continuous batching, which is the fair comparator for
a batching worker. PyPI's llama-cpp-python source distribution vendors llama.cpp, so
the server is built from that pinned source: no network beyond the package index.

    python bench/llama_server.py        # build (or find) it and print its path
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("LLORCH_BENCH_CACHE", Path.home() / ".cache" / "llorch-bench"))


def ensure_llama_server() -> Path:
    """The path of a native-CPU llama-server binary, building it on first use (several minutes)."""
    binary = CACHE / LLAMA_CPP_PYTHON.replace("==", "-") / "llama-server"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(work), LLAMA_CPP_PYTHON], check=True, stdout=subprocess.DEVNULL)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=subprocess.DEVNULL)
        built = next(build.rglob("llama-server"))
        built.replace(binary)
    return binary


if __name__ == "__main__":
    print(ensure_llama_server())
