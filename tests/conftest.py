"""Shared fixtures: the default model, the transformers reference (loaded once), a live worker.

Backend marks: a test marked `cuda` or `accelerate` is skipped with the reason when
this machine lacks that backend, unless the machine says it must have it
(LLORCH_REQUIRE_BACKENDS=cuda,accelerate or `require_backends = [...]` in a
git-ignored .llorch-test.toml), in which case it fails instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from llorch.device import resolve_backend
from llorch.errors import BackendUnavailable
from llorch.models.paged import LayerKV, allocate_kv, contiguous_step
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model

# The references load local files only; never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite converts and caches many throwaway models: it gets a cache of its own (worker
# subprocesses inherit it), so it never fills the user's and always tests a cold start.
if "LLORCH_CACHE_DIR" not in os.environ:
    os.environ["LLORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="llorch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LLORCH_CACHE_DIR"], ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT_S = 120


def required_backends() -> set[str]:
    required = {b.strip() for b in os.environ.get("LLORCH_REQUIRE_BACKENDS", "").split(",") if b.strip()}
    local = ROOT / ".llorch-test.toml"
    if local.is_file():
        required |= set(tomllib.loads(local.read_text()).get("require_backends", []))
    return required


def pytest_runtest_setup(item: pytest.Item) -> None:
    for backend in ("cuda", "accelerate"):
        if item.get_closest_marker(backend) is None:
            continue
        try:
            resolve_backend(backend)
        except BackendUnavailable as exc:
            if backend in required_backends():
                pytest.fail(f"required backend missing: {exc}")
            pytest.skip(str(exc))


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def ours(model_path: Path) -> LoadedModel:
    """Our model on the CPU with every weight dequantized to float32 (the worker's --dequantize):
    the path compared with transformers."""
    return load_model(model_path, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def served(model_path: Path) -> LoadedModel:
    """Our model as the CPU worker serves it by default: GGUF matrices kept as int8 blocks."""
    return load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)


@dataclass
class Reference:
    model: object
    tokenizer: object


@pytest.fixture(scope="session")
def reference(model_path: Path) -> Reference:
    """Hugging Face transformers loading the same GGUF (dequantized to float32)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"gguf_file": model_path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path.parent, dtype=torch.float32, **kwargs)
    return Reference(model=model.eval(), tokenizer=tokenizer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Worker:
    process: subprocess.Popen[str]
    base_url: str
    log_path: Path

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def worker_command(program: str) -> list[str]:
    """The installed program, or (in a checkout used through PYTHONPATH) its entry point."""
    script = Path(sys.executable).parent / program
    if script.exists():
        return [str(script)]
    backend = program.removeprefix("llorch-").removesuffix("-worker")
    entry = f"import sys; from llorch.workers import run_worker; sys.exit(run_worker({backend!r}))"
    return [sys.executable, "-c", entry]


def start_worker(tmp: Path, *extra: str, program: str = "llorch-cpu-worker") -> Worker:
    port = free_port()
    log_path = tmp / f"worker-{port}.log"
    handle = log_path.open("w")
    process = subprocess.Popen(
        [*worker_command(program), "--port", str(port), "--log-format", "text", *extra],
        stdout=handle, stderr=subprocess.STDOUT, text=True,
    )
    worker = Worker(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode}:\n{worker.log()}")
        try:
            # /health answers while the model loads; the worker is ready when it says healthy.
            if httpx.get(f"{worker.base_url}/health", timeout=1).json().get("status") == "healthy":
                return worker
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_worker(worker)
    raise RuntimeError(f"worker did not become ready:\n{worker.log()}")


def stop_worker(worker: Worker) -> None:
    if worker.process.poll() is None:
        worker.process.terminate()
        try:
            worker.process.wait(15)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One real CPU worker subprocess on a free port, shared by the HTTP tests."""
    live = start_worker(tmp_path_factory.mktemp("worker"))
    yield live
    stop_worker(live)


def new_cache(loaded: LoadedModel, capacity: int) -> list[LayerKV]:
    """An empty KV cache of `capacity` slots on the model's device, in its compute dtype."""
    return allocate_kv(loaded.config, capacity, loaded.dtype, model_device(loaded), zeroed=True)


def model_device(loaded: LoadedModel) -> torch.device:
    return loaded.model.embed_tokens.weight.device


def all_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Float32 logits on the CPU for every position of `ids`, straight from the decoder."""
    device = model_device(loaded)
    step = contiguous_step(loaded.config, 0, len(ids), device, last_only=False)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids, device=device), step, new_cache(loaded, len(ids)))
    return logits.float().cpu()


def greedy_ids(loaded: LoadedModel, ids: list[int], count: int, stop_at_eos: bool = True) -> list[int]:
    """Up to `count` greedy tokens after `ids`, straight from the decoder (no engine)."""
    cache = new_cache(loaded, len(ids) + count)
    device, config = model_device(loaded), loaded.config
    out: list[int] = []
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids, device=device), contiguous_step(config, 0, len(ids), device), cache)
        while len(out) < count:
            token = int(logits[-1].argmax())
            if stop_at_eos and token in loaded.tokenizer.eos_token_ids:
                break
            out.append(token)
            step = contiguous_step(config, len(ids) + len(out) - 1, 1, device)
            logits = loaded.model(torch.tensor([token], device=device), step, cache)
    return out
