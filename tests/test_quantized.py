"""GGUF weights kept quantized: the int8 kernels, the repacking, its accuracy cost, the conversion cache.

The reference for the quantized path is the same file dequantized to float32, which the
other suites check against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import Worker, all_logits, greedy_ids, start_worker, stop_worker
from llorch.kernels import build, q8
from llorch.models.decoder import concat_linears
from llorch.models.quantized import Q8Embedding, Q8Linear
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import LoadedModel, load_model

pytestmark = pytest.mark.cpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Die Katze sitzt auf der",
           "Explain quantum computing in simple terms."]


@pytest.fixture(scope="module")
def quantized(model_path: Path) -> LoadedModel:
    return load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)


# --- kernels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
def test_int8_matmul_equals_the_float_product_with_the_dequantized_matrix(rows: int) -> None:
    """Both kernel paths (the C kernel up to DOT_MAX_ROWS rows, float GEMM above) compute
    the product with the dequantized matrix, up to float rounding."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 256, generator=generator)
    values, scales = q8.quantize_blocks(weight)
    x = torch.randn(rows, 256, generator=generator) * 3
    expected = x.double() @ q8.dequantize(values, scales).double().T
    got = q8.matmul(x, values, scales).double()
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_kernel_gives_a_row_the_same_bits_whatever_rows_share_the_call() -> None:
    """Decoding jobs batched together get exactly the numbers each gets alone."""
    generator = torch.Generator().manual_seed(7)
    values, scales = q8.quantize_blocks(torch.randn(64, 128, generator=generator))
    x = torch.randn(q8.DOT_MAX_ROWS, 128, generator=generator)
    together = q8.matmul(x, values, scales)
    for size in (1, 2, 3, 5, 7):
        for start in range(0, q8.DOT_MAX_ROWS - size + 1, size):
            assert torch.equal(q8.matmul(x[start : start + size], values, scales), together[start : start + size])


def test_block_quantization_error_is_at_most_half_a_step() -> None:
    weight = torch.randn(50, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 96)
    values, scales = q8.quantize_blocks(weight)
    error = (q8.dequantize(values, scales) - weight).abs().reshape(50, 3, 32)
    assert bool((error <= scales[..., None] / 2 * (1 + 1e-5)).all())
    assert values.abs().max() <= 127


def test_rows_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="32-value blocks"):
        q8.quantize_blocks(torch.ones(4, 40))


def test_embedding_lookup_reads_dequantized_rows_and_refuses_ids_out_of_range() -> None:
    values, scales = q8.quantize_blocks(torch.randn(10, 64))
    embedding = Q8Embedding(10, 64, torch.float32)
    embedding.weight, embedding.weight_scales = values, scales
    ids = torch.tensor([3, 0, 9, 3])
    assert torch.equal(embedding(ids), q8.dequantize(values, scales)[ids])
    for bad in (10, -1):
        with pytest.raises(IndexError, match="out of range"):
            embedding(torch.tensor([1, bad]))


def test_fused_layers_compute_their_parts_side_by_side() -> None:
    parts = []
    for rows in (32, 64, 32):
        layer = Q8Linear(128, rows, True, torch.float32)
        layer.weight, layer.weight_scales = q8.quantize_blocks(torch.randn(rows, 128))
        layer.bias = torch.nn.Parameter(torch.randn(rows), requires_grad=False)
        parts.append(layer)
    x = torch.randn(2, 128)
    assert torch.equal(concat_linears(parts)(x), torch.cat([p(x) for p in parts], dim=-1))


def test_a_missing_compiler_is_reported_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        build.build_library()


def test_the_kernel_library_is_built_once_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    first = build.build_library()
    stamp = first.stat().st_mtime_ns
    assert build.build_library() == first and first.stat().st_mtime_ns == stamp


# --- repacking GGUF tensors --------------------------------------------------------------------

def test_every_quant_type_of_the_default_model_repacks_faithfully(model_path: Path) -> None:
    """Q8_0 and Q5_0 blocks are 32 values times one scale: exact. Q4_K and Q6_K are
    requantized per block: within half an int8 step of the file's values."""
    gguf = GGUFFile(model_path)
    seen = set()
    for name, info in gguf.tensors.items():
        if info.qtype.name in seen or not gguf.is_block_quantized(name) or info.shape[0] > 4096:
            continue
        seen.add(info.qtype.name)
        values, scales = gguf.q8_blocks(name)
        reference = gguf.dequantize(name)
        error = (q8.dequantize(values, scales) - reference).abs()
        if info.qtype.name in ("Q8_0", "Q5_0"):
            assert torch.equal(error, torch.zeros_like(error)), info.qtype.name
        else:
            assert bool((error <= scales.repeat_interleave(32, dim=1) / 2 * (1 + 1e-5)).all()), info.qtype.name
    assert seen >= {"Q5_0", "Q4_K", "Q6_K"}
    embedding = gguf.q8_blocks("token_embd.weight")  # the Q8_0 tensor
    assert torch.equal(q8.dequantize(*embedding)[:64], gguf.dequantize("token_embd.weight")[:64])


# --- accuracy cost on the default model ----------------------------------------------------------

def test_quantized_model_holds_int8_blocks_not_float_copies(quantized: LoadedModel, ours: LoadedModel) -> None:
    model = quantized.model
    assert isinstance(model.embed_tokens, Q8Embedding)
    assert isinstance(model.layers[0].self_attn.qkv_proj, Q8Linear)
    state = model.state_dict()
    matrices = {name for name, t in state.items() if t.dim() == 2}
    assert {name for name in matrices if state[name].is_floating_point()} == {
        name for name in matrices if name.endswith("_scales")}
    total = sum(t.numel() * t.element_size() for t in state.values())
    dense = sum(t.numel() * t.element_size() for t in ours.model.state_dict().values())
    assert total < 0.3 * dense  # int8 values + a float32 scale per 32 against float32: about 28%


def test_quantized_logits_stay_close_to_the_dequantized_reference(quantized: LoadedModel, ours: LoadedModel) -> None:
    """The accuracy cost of int8 weights and activations, measured along each reference
    greedy continuation: relative RMS of the logits, the largest difference, and how
    often the top token agrees (teacher-forced, so one early divergence does not count
    for every later position). Measured: relative RMS 0.7-1.1%, largest difference
    under 2.5% of the largest logit, top token agreeing at 96-100% of positions.
    Activations stay float32, so this is the cost of the int8 weights alone."""
    agreements = []
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        sequence = ids + greedy_ids(ours, ids, 48, False)
        mine, reference = all_logits(quantized, sequence), all_logits(ours, sequence)
        assert float((mine - reference).norm() / reference.norm()) < 0.02, prompt
        assert (mine - reference).abs().max() < 0.04 * reference.abs().max(), prompt
        predicted = slice(len(ids) - 1, len(sequence) - 1)
        agreements.append(float((mine[predicted].argmax(-1) == reference[predicted].argmax(-1)).float().mean()))
    assert min(agreements) >= 0.9 and sum(agreements) / len(agreements) >= 0.95, agreements


# --- the conversion cache -----------------------------------------------------------------------

def test_a_warm_load_reads_the_cache_and_not_the_gguf_file(
    model_path: Path, quantized: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    ids = quantized.tokenizer.encode(PROMPTS[0])
    expected = all_logits(quantized, ids)
    cold = load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)
    entry = next((tmp_path / "converted").iterdir())
    assert {p.name for p in entry.iterdir()} == {"meta.json", "tokenizer.json", "q8-float32.safetensors"}

    def no_parsing(*_: object) -> None:
        raise AssertionError("a warm start parsed the GGUF file")

    monkeypatch.setattr("llorch.weights.loader.GGUFFile", no_parsing)
    warm = load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)
    assert warm.config == cold.config and warm.chat_template == cold.chat_template
    assert warm.tokenizer.encode(PROMPTS[2]) == quantized.tokenizer.encode(PROMPTS[2])
    assert warm.tokenizer.eos_token_ids == quantized.tokenizer.eos_token_ids
    assert warm.tokenizer.byte_token_ids == quantized.tokenizer.byte_token_ids
    assert torch.equal(all_logits(warm, ids), expected) and torch.equal(all_logits(cold, ids), expected)


def test_a_damaged_cache_entry_is_rebuilt_not_trusted(
    model_path: Path, quantized: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)
    entry = next((tmp_path / "converted").iterdir())
    (entry / "meta.json").write_text(json.dumps({"name": "broken"}))
    weights = entry / "q8-float32.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rebuilt = load_model(model_path, torch.device("cpu"), torch.float32, keep_quantized=True)
    ids = quantized.tokenizer.encode(PROMPTS[1])
    assert torch.equal(all_logits(rebuilt, ids), all_logits(quantized, ids))
    assert json.loads((entry / "meta.json").read_text())["config"]["architecture"] == "gemma3"


# --- the worker -----------------------------------------------------------------------------------

def test_the_cpu_worker_serves_int8_blocks_and_dequantize_gives_float_weights(worker: Worker, tmp_path: Path) -> None:
    assert "weights=int8 blocks" in worker.log()
    quantized_bytes = httpx.get(f"{worker.base_url}/health").json()["vram_bytes"]
    dense = start_worker(tmp_path, "--dequantize", "--kv-cache-mb", "16")
    try:
        assert "weights=dense" in dense.log()
        assert httpx.get(f"{dense.base_url}/health").json()["vram_bytes"] > 1_000_000_000  # float32 weights
    finally:
        stop_worker(dense)
    assert quantized_bytes < 1_000_000_000


def test_the_c_rms_norm_matches_the_torch_one() -> None:
    from llorch.kernels.norm import rms_norm
    from llorch.models.decoder import RMSNorm

    norm = RMSNorm(256, 1e-6)
    norm.weight.data = torch.rand(256) + 0.5
    x = torch.randn(3, 4, 256) * 10
    expected = norm(x)
    norm.native = True
    assert torch.allclose(norm(x), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(rms_norm(x[:, 1], norm.weight.data, 1e-6), expected[:, 1], rtol=1e-5, atol=1e-6)
