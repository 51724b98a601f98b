"""Tiny random models of every supported architecture, built with transformers in the tests.

- `train_tokenizer` trains a small byte-level BPE vocabulary (Llama 3's split pattern)
  on a multilingual corpus, so no tokenizer has to be downloaded;
- `build_hf_model` writes a Hugging Face directory (config.json, safetensors,
  tokenizer.json, tokenizer_config.json, generation_config.json) from a transformers
  model with random weights;
- `export_gguf` converts such a directory to GGUF the way llama.cpp's converter does
  (its tensor names, metadata keys, q/k row permutation for `llama`, Gemma's 1 + w
  norms, Llama 3.1's rope_freqs tensor), in F32, F16, Q8_0, Q4_0 or Q6_K.
This is test code written from llama.cpp's documented conventions; the loader's undoing
of them is checked against transformers loading the same GGUF files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Ünïcödé àccents: déjà vu, naïve café, Straße, øre, ñandú. Les élèves étudient.",
    "中文字符测试，日本語のテキスト、한국어 문장입니다. 海はとても広い。",
    "Ελληνικά, русский язык, العربية, עברית, हिन्दी, ไทย",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers 12345 and 3.14159, emoji 🎉👍🏽, tabs\tand\n\nnewlines.",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + EOT + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Shapes every tiny model shares: rows of 256 so K-quants (256-value blocks) apply everywhere.
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64


def train_tokenizer(vocab_size: int = 640) -> Tokenizer:
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


@dataclass(frozen=True)
class Arch:
    """One architecture's transformers config class and settings for a tiny model."""

    name: str
    config_class: str
    settings: dict[str, Any] = field(default_factory=dict)
    layers: int = 2

    def build_config(self, vocab_size: int, bos: int, eos: int) -> Any:
        import transformers

        cls = getattr(transformers, self.config_class)
        settings = dict(
            vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=self.layers,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            max_position_embeddings=4096, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
        )
        return cls(**{**settings, **self.settings})


ARCHITECTURES = {
    arch.name: arch for arch in [
        Arch("llama", "LlamaConfig", {"tie_word_embeddings": False}),
        Arch("llama3-scaled", "LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        Arch("mistral", "MistralConfig", {"sliding_window": 5, "tie_word_embeddings": False}),
        Arch("qwen2", "Qwen2Config", {"tie_word_embeddings": True}),
        Arch("qwen3", "Qwen3Config", {"tie_word_embeddings": False}),
        Arch("phi3", "Phi3Config", {"tie_word_embeddings": False}),
        # query_pre_attn_scalar = head_dim, as in released Gemma 3 sizes (GGUF does not store it).
        Arch("gemma3", "Gemma3TextConfig", {"sliding_window": 5, "head_dim": 256, "query_pre_attn_scalar": 256},
             layers=6),
    ]
}


def build_hf_model(arch: Arch, directory: Path, tokenizer: Tokenizer, seed: int = 0) -> Path:
    """A Hugging Face directory holding a tiny random `arch` model and the tokenizer."""
    import transformers

    bos, eos, eot = (tokenizer.token_to_id(t) for t in (BOS, EOS, EOT))
    config = arch.build_config(tokenizer.get_vocab_size(), bos, eos)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random values everywhere (norms and biases too, which default to constants), large
    # enough that the logits spread over several units and greedy choices are clear.
    gemma = arch.name.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            if param.ndim == 1 and "norm" in name:
                param.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            else:
                param.copy_(noise * (0.5 if "embed" in name else 0.1))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
    }))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": [eos, eot]}))
    return directory


# --- GGUF export, following llama.cpp's converter --------------------------------------------

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma3_text": "gemma3"}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
Q = gguf.GGMLQuantizationType


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (pairs interleaved per head)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Q6_K blocks (256 values: 16 int8 sub-block scales, one f16 scale, 6-bit values).

    A plain round-to-nearest quantizer (llama.cpp's searches for better scales); the
    bit layout is ggml's, which the tests check against gguf's dequantizer.
    """
    rows, cols = values.shape
    x = values.reshape(-1, 256).astype(np.float32)
    sub = x.reshape(-1, 16, 16)
    sub_scale = np.abs(sub).max(-1) / 31.0
    d = np.abs(sub_scale).max(-1) / 127.0
    d = np.where(d == 0, 1.0, d).astype(np.float16).astype(np.float32)
    scales = np.clip(np.round(sub_scale / d[:, None]), -128, 127)
    step = d[:, None] * scales
    q = np.clip(np.round(sub / np.where(step == 0, 1.0, step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [block, half, group of 32, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=-1)
    return blocks.reshape(rows, cols // 256 * 210)


def encode_tensor(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """A weight as llama.cpp writes it: 1-D tensors and rows that do not fit the block stay F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.ndim == 1 or values.shape[-1] % block:
        return values.astype(np.float32), Q.F32
    if qtype == Q.F32:
        return values.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return values.astype(np.float16), Q.F16
    if qtype == Q.Q6_K:
        return quantize_q6_k(values), Q.Q6_K
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def export_gguf(directory: Path, path: Path, qtype: Q, raw_types: dict[str, Q] | None = None) -> Path:
    """`directory` as GGUF in `qtype`; `raw_types` writes the named tensors as zero blocks of another type."""
    config = json.loads((directory / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    state = {k: v.float().numpy() for k, v in load_file(directory / "model.safetensors").items()}
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {model_type}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    rope = rope["full_attention"] if arch == "gemma3" else rope
    writer.add_rope_freq_base(rope["rope_theta"])
    if config.get("sliding_window") and arch not in ("qwen2", "qwen3"):
        writer.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(directory))
    _add_tokenizer(writer, directory)

    def add(name: str, values: np.ndarray) -> None:
        if raw_types and name in raw_types:
            block, size = gguf.GGML_QUANT_SIZES[raw_types[name]]
            zeros = np.zeros((values.shape[0], values.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, zeros, raw_dtype=raw_types[name])
            return
        data, kind = encode_tensor(values, qtype)
        writer.add_tensor(name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)

    for name, values in state.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma's norms as the effective multiplier
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", values)
        elif name == "model.norm.weight":
            add("output_norm.weight", values)
        elif name == "lm_head.weight":
            if not config.get("tie_word_embeddings"):
                add("output.weight", values)
        else:
            _, _, index, module = name.split(".", 3)
            module, kind = module.rsplit(".", 1)
            if module == "post_attention_layernorm":
                gguf_name = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
            else:
                gguf_name = _LAYER_NAMES[module]
            if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                values = llama_cpp_permute(values, heads if gguf_name == "attn_q" else kv_heads)
            add(f"blk.{index}.{gguf_name}.{kind}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_factors(directory: Path) -> np.ndarray:
    """Llama 3.1's scaling as llama.cpp stores it: default inverse frequencies over the scaled ones."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.AutoConfig.from_pretrained(directory)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (default / scaled).numpy().astype(np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, directory: Path) -> None:
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[BOS])
    writer.add_eos_token_id(vocab[EOS])
    writer.add_eot_token_id(vocab[EOT])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
