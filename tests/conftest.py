"""Shared fixtures: the default model, the transformers reference (loaded once), a live worker.

Backend marks: a test marked `cuda` or `accelerate` is skipped with the reason when
this machine lacks that backend, unless the machine says it must have it
(LLORCH_REQUIRE_BACKENDS=cuda,accelerate or `require_backends = [...]` in a
git-ignored .llorch-test.toml), in which case it fails instead.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from gguf import GGMLQuantizationType

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from launch import Server as Worker
from launch import free_port, start_worker, worker_command
from launch import stop as stop_worker
from llorch.device import resolve_backend
from llorch.engine.kv.pool import allocate_kv
from llorch.errors import BackendUnavailable
from llorch.models.step_batch import contiguous_step
from llorch.models.step_layout import LayerKV
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model
from llorch.weights.tokenizer import tokenizer_from_gguf

__all__ = ["Worker", "free_port", "start_worker", "stop_worker"]  # the shared launcher, for the test modules

# The references load local files only; never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite converts and caches many throwaway models: it gets a cache of its own (worker
# subprocesses inherit it), so it never fills the user's and always tests a cold start.
if "LLORCH_CACHE_DIR" not in os.environ:
    os.environ["LLORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="llorch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LLORCH_CACHE_DIR"], ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]


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
    """Our model as the CPU worker serves it by default: GGUF matrices in the file's own blocks, run by the C step."""
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


@pytest.fixture(scope="session")
def sentencepiece_vocab() -> tuple[object, Any]:
    """A Llama-2-style SentencePiece BPE (dummy prefix, byte fallback) trained here, and ours
    built from the same vocabulary as a GGUF file carries it."""
    spm = pytest.importorskip("sentencepiece")
    from model_zoo import CORPUS

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=proto, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, add_dummy_prefix=True, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, normalization_rule_name="identity", minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    ids = range(sp.vocab_size())
    kinds = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    metadata = {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
        "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in ids], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(kinds), "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(), "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    return sp, tokenizer_from_gguf(metadata, Path("spm.gguf"))


# llama.cpp's mean KL divergence against the default model's file dequantized in float32,
# measured on 256 tokens of English licence text on 2026-11-23 (the issue that set the
# goal): ours must stay at or below it.
LLAMA_CPP_KL = 0.0063


def english_text() -> str:
    """Real English prose that ships with every CPython: its licence."""
    import sys

    return Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                "LICENSE.txt").read_text(encoding="utf-8")


def run_worker_to_exit(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """A cpu worker run to its exit (for start-up failures), its output captured."""
    return subprocess.run([*worker_command(), "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_failure(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    # Progress is logged as JSON lines on stderr; the failure itself is the one plain line.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One real CPU worker subprocess on a free port, shared by the HTTP tests."""
    live = start_worker(tmp_path_factory.mktemp("worker"))
    yield live
    stop_worker(live)


@pytest.fixture(scope="session")
def client(worker: Worker) -> openai.OpenAI:
    """The openai client on the shared worker (modules with a worker of their own override it)."""
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Hugging Face directory per architecture, built once per test session."""
    from model_zoo import ARCHITECTURES, build_hf_model, train_tokenizer

    root = tmp_path_factory.mktemp("zoo")
    tokenizer = train_tokenizer()
    return {name: build_hf_model(arch, root / name, tokenizer) for name, arch in ARCHITECTURES.items()}


def exported(zoo: dict[str, Path], arch: str, qtype: GGMLQuantizationType) -> Path:
    """The zoo's `arch` model as a GGUF file of `qtype` (written once per session)."""
    from model_zoo import export_gguf

    path = zoo[arch].parent / f"{arch}-{qtype.name}.gguf"
    if not path.exists():
        export_gguf(zoo[arch], path, qtype)
    return path


def new_cache(loaded: LoadedModel, capacity: int, dtype: torch.dtype | None = None) -> list[LayerKV]:
    """An empty KV cache of `capacity` slots on the model's device: in `dtype`, by default float16
    where the C step computes the model (the form it keeps keys and values in), else the compute dtype."""
    dtype = dtype or (torch.float16 if loaded.native is not None else loaded.dtype)
    return allocate_kv(loaded.config, capacity, dtype, model_device(loaded), zeroed=True)


def model_device(loaded: LoadedModel) -> torch.device:
    return loaded.model.embed_tokens.weight.device


def all_logits(loaded: LoadedModel, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float32 logits on the CPU for every position of `ids`, straight from the decoder (its KV cache
    as new_cache makes it)."""
    device = model_device(loaded)
    step = contiguous_step(loaded.config, 0, len(ids), device, last_only=False)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids, device=device), step, new_cache(loaded, len(ids), kv_dtype))
    return logits.float().cpu()


def prompt_row_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """all_logits of a model the C step computes, with every row a prompt row (runner.ChunkInput.prompt)."""
    assert loaded.native is not None
    step = contiguous_step(loaded.config, 0, len(ids), torch.device("cpu"), last_only=False)
    arrays = [(layer.keys.numpy(), layer.values.numpy()) for layer in new_cache(loaded, len(ids))]
    return torch.from_numpy(loaded.native.forward(np.array(ids), step.layout, arrays, torch.get_num_threads(),
                                                  prompt_from=0)).float()


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
