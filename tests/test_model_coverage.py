"""Every supported architecture, from a Hugging Face directory and from GGUF, against transformers.

Tiny random models of each architecture are built with transformers and saved as
safetensors, then converted to GGUF the way llama.cpp does (model_zoo.py).

Tolerances, and why:
- float32 from safetensors: both sides run the same float32 arithmetic in a
  different order (SDPA and fused matmuls against eager ops), so logits agree to
  ~1e-5 on logits that spread over several units; 1e-4 leaves room for that and
  nothing else. On CUDA, kernels reorder sums more, hence 1e-3.
- bfloat16 / float16 compute: one rounding per op at 8 (bf16) or 11 (f16) mantissa
  bits; over two layers that is a few percent of the logits' spread, so we bound the
  max difference by 8% (bf16) / 1% (f16) of the largest logit.
- GGUF vs our own safetensors load: the difference is the quantization alone, as
  relative RMS error of all logits: a few 1e-3 for F16, a few 1e-2 for Q8_0, about
  0.1 for Q6_K and 0.4-0.5 for Q4_0 on these random, unstructured weights. Each bound
  is about 1.5x what was measured; a layout mistake (a wrong permutation or split)
  gives ~1.4 (uncorrelated logits), far above every bound.
- GGUF vs transformers loading the same GGUF: both dequantize the same blocks, so
  it is the float32 tolerance again. transformers cannot load all of these files the
  way llama.cpp defines them (it ignores rope_freqs and the llama sliding window,
  assumes Qwen3's head_dim, and rejects Phi-3's pad id), so that check runs for the
  architectures it reads faithfully.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from conftest import all_logits, exported, greedy_ids
from llorch.weights.loader import LoadedModel, load_model
from model_zoo import ARCHITECTURES, EOS, EOT, Q

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé àccents: déjà vu, 中文字符测试 한국어",
    "def fibonacci(n):\n    return n",
]
MULTILINGUAL = [
    *PROMPTS,
    "emoji 🎉👍🏽 family 👨‍👩‍👧 and numbers 1234567 3.14159",
    "  leading spaces,   runs,\ttabs\t\t and\n\n\nnewlines\r\n",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย — unseen scripts fall back to bytes",
    f"{EOT} special tokens stay whole {EOS}",
    "",
]
DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("cuda", marks=pytest.mark.cuda)]
F32_ATOL = {"cpu": 1e-4, "cuda": 1e-3}
HALF_RELATIVE = {torch.bfloat16: 0.08, torch.float16: 0.01}
QUANT_RELATIVE_RMS = {Q.F32: 1e-5, Q.F16: 0.005, Q.Q8_0: 0.06, Q.Q6_K: 0.2, Q.Q4_0: 0.75}
TRANSFORMERS_READS_GGUF = ("llama", "qwen2", "gemma3")


_loaded: dict[tuple[str, str, torch.dtype], LoadedModel] = {}
_references: dict[str, object] = {}


def ours(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    key = (str(path), device, dtype)
    if key not in _loaded:
        _loaded[key] = load_model(path, torch.device(device), dtype)
    return _loaded[key]


def reference(directory: Path) -> object:
    if str(directory) not in _references:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        _references[str(directory)] = model.eval()
    return _references[str(directory)]


def reference_logits(model: object, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]


def relative_rms(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((mine - theirs).norm() / theirs.norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_safetensors_logits_match_transformers(zoo: dict[str, Path], arch: str, device: str) -> None:
    model = ours(zoo[arch], device)
    ref = reference(zoo[arch])
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    for ids in prompts:
        mine, theirs = all_logits(model, ids), reference_logits(ref, ids)
        assert mine.shape == theirs.shape == (len(ids), model.config.vocab_size)
        assert (mine - theirs).abs().max().item() < F32_ATOL[device]
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    # The reference run as one right-padded batch gives the same logits at every real position.
    longest = max(len(ids) for ids in prompts)
    batch = torch.tensor([ids + [0] * (longest - len(ids)) for ids in prompts])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in prompts])
    with torch.inference_mode():
        batched = ref(batch, attention_mask=mask).logits.float()  # type: ignore[operator]
    for row, ids in enumerate(prompts):
        assert (all_logits(model, ids) - batched[row, : len(ids)]).abs().max().item() < F32_ATOL[device] * 10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_continuations_match_transformers(zoo: dict[str, Path], arch: str, device: str) -> None:
    """Decoding past the sliding window (5 tokens for mistral and gemma3) through the KV cache."""
    model = ours(zoo[arch], device)
    ref = reference(zoo[arch])
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        generated = greedy_ids(model, ids, 16, stop_at_eos=False)
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)  # type: ignore[attr-defined]
        expected = expected[0, len(ids):].tolist()
        assert generated[: len(expected)] == expected
        if len(expected) < 16:  # the reference stopped at an end-of-generation id: it must be one of ours
            assert generated[len(expected)] in model.tokenizer.eos_token_ids


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_half_precision_stays_close_to_float32_reference(zoo: dict[str, Path], arch: str, dtype: torch.dtype) -> None:
    model = ours(zoo[arch], "cpu", dtype)
    ref = reference(zoo[arch])
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        mine, theirs = all_logits(model, ids), reference_logits(ref, ids)
        assert (mine - theirs).abs().max().item() < HALF_RELATIVE[dtype] * theirs.abs().max().item()


@pytest.mark.cpu
@pytest.mark.parametrize("qtype", list(QUANT_RELATIVE_RMS), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gguf_matches_our_safetensors_within_quantization_error(zoo: dict[str, Path], arch: str, qtype: Q) -> None:
    from_gguf = ours(exported(zoo, arch, qtype))
    from_safetensors = ours(zoo[arch])
    assert from_gguf.config == from_safetensors.config or _same_shape_config(from_gguf, from_safetensors)
    for prompt in PROMPTS:
        ids = from_safetensors.tokenizer.encode(prompt)
        assert from_gguf.tokenizer.encode(prompt) == ids
        error = relative_rms(all_logits(from_gguf, ids), all_logits(from_safetensors, ids))
        assert error < QUANT_RELATIVE_RMS[qtype], f"{arch} {qtype.name}: relative RMS {error:.4f}"
    if qtype == Q.F32:  # no quantization: the same tokens
        ids = from_safetensors.tokenizer.encode(PROMPTS[0])
        assert greedy_ids(from_gguf, ids, 16, False) == greedy_ids(from_safetensors, ids, 16, False)


def _same_shape_config(a: LoadedModel, b: LoadedModel) -> bool:
    """GGUF does not carry every config.json field (eos lists, llama3 rope as metadata), but the shapes agree."""
    fields = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "sliding_layers", "sliding_window", "qkv_bias", "qk_norm", "sandwich_norms", "tie_word_embeddings")
    return all(getattr(a.config, f) == getattr(b.config, f) for f in fields)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", TRANSFORMERS_READS_GGUF)
def test_gguf_matches_transformers_reading_the_same_file(
    zoo: dict[str, Path], arch: str, qtype: Q, device: str
) -> None:
    path = exported(zoo, arch, qtype)
    model = ours(path, device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        mine, theirs = all_logits(model, ids), reference_logits(ref.eval(), ids)
        assert (mine - theirs).abs().max().item() < F32_ATOL[device]


# --- byte-level BPE tokenizer: tokenizer.json and GGUF metadata against transformers ---------------

@pytest.fixture(scope="module")
def bpe_references(zoo: dict[str, Path]) -> tuple[object, object]:
    """transformers' tokenizer from the directory, and from the GGUF file's metadata."""
    path = exported(zoo, "llama", Q.F32)
    from_dir = transformers.AutoTokenizer.from_pretrained(zoo["llama"])
    from_gguf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return from_dir, from_gguf


@pytest.mark.cpu
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_bpe_tokenizers_match_transformers(
    zoo: dict[str, Path], bpe_references: tuple[object, object], text: str
) -> None:
    from_dir = ours(zoo["llama"]).tokenizer
    from_gguf = ours(exported(zoo, "llama", Q.F32)).tokenizer
    for reference_tokenizer in bpe_references:
        expected = reference_tokenizer(text).input_ids  # type: ignore[operator]
        for tokenizer in (from_dir, from_gguf):
            ids = tokenizer.encode(text)
            assert ids == expected
            assert tokenizer.decode(ids) == reference_tokenizer.decode(expected, skip_special_tokens=True)  # type: ignore[attr-defined]
            assert tokenizer.decode(ids, skip_special=False) == reference_tokenizer.decode(expected)  # type: ignore[attr-defined]


@pytest.mark.cpu
def test_directory_settings_reach_the_worker(zoo: dict[str, Path]) -> None:
    """EOS ids from generation_config.json, BOS and the chat template from tokenizer_config.json."""
    model = ours(zoo["llama"])
    vocab = HFTokenizer.from_file(str(zoo["llama"] / "tokenizer.json")).get_vocab()
    assert model.tokenizer.eos_token_ids == {vocab[EOS], vocab[EOT]}
    assert model.tokenizer.encode("hi")[0] == model.tokenizer.bos_token_id
    assert model.chat_template is not None and "add_generation_prompt" in model.chat_template
    assert model.model_id == "llama"
    gguf_model = ours(exported(zoo, "llama", Q.F32))
    assert gguf_model.tokenizer.eos_token_ids == {vocab[EOS], vocab[EOT]}
    assert gguf_model.chat_template == model.chat_template
