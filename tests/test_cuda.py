"""The CUDA worker end to end, on a GPU: it serves what the CPU computes, and keeps everything on the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import greedy_ids, start_worker, stop_worker
from llorch.device import assert_module_resident, resolve_backend
from llorch.weights.loader import load_model
from model_zoo import ARCHITECTURES, Q, build_hf_model, export_gguf, train_tokenizer

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-zoo")
    directory = build_hf_model(ARCHITECTURES["qwen2"], root / "tiny-qwen2", train_tokenizer())
    return {"safetensors": directory, "gguf-q8_0": export_gguf(directory, root / "tiny-qwen2-q8.gguf", Q.Q8_0)}


@pytest.mark.parametrize("kind", ["safetensors", "gguf-q8_0"])
def test_model_is_resident_on_the_gpu_and_greedy_matches_cpu(tiny_models: dict[str, Path], kind: str) -> None:
    device = torch.device(resolve_backend("cuda").device)  # the backend names it; residency checks take a device
    on_gpu = load_model(tiny_models[kind], device, torch.float32)
    on_cpu = load_model(tiny_models[kind], torch.device("cpu"), torch.float32)
    assert_module_resident(device, on_gpu.model)
    ids = on_cpu.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert greedy_ids(on_gpu, ids, 24, stop_at_eos=False) == greedy_ids(on_cpu, ids, 24, stop_at_eos=False)


def test_cuda_worker_streams_the_cpu_greedy_tokens(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    directory = tiny_models["safetensors"]
    on_cpu = load_model(directory, torch.device("cpu"), torch.float32)
    prompt = "The quick brown fox"
    expected = on_cpu.tokenizer.decode(greedy_ids(on_cpu, on_cpu.tokenizer.encode(prompt), 12))
    worker = start_worker(tmp_path, "--model", str(directory), "--dtype", "f32", program="llorch-cuda-worker")
    try:
        with worker.client() as client:
            health = client.get("/health").json()
            assert health["device"].startswith("cuda") and health["vram_bytes"] > 0
            body = {"job_id": "gpu-1", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            response = client.post("/execute", json=body, headers={"Accept": "application/x-ndjson"})
            events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        text = "".join(e["t"] for e in events if e["type"] == "token")
        assert events[-1]["type"] == "end"
        assert text == expected
    finally:
        stop_worker(worker)
