"""GGUF metadata -> ModelConfig, and GGUF tensors -> the decoder's state dict.

llama.cpp's conversion conventions are undone here, so the decoder sees the same
numbers a Hugging Face checkpoint would give it (modulo quantization).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from llorch.errors import ModelFileError
from llorch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llorch.weights.gguf import GGUFFile

# Gemma 3 conventions llama.cpp hard-codes instead of storing: every sixth layer is
# global, the others slide; sliding layers use RoPE base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0

# GGUF per-layer tensor names -> our module names.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFileError(gguf.path, "has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            gguf.path, f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelFileError(gguf.path, f"metadata {full} is missing")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    layers = int(need("block_count"))
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelFileError(gguf.path, "tensor token_embd.weight is missing")
    vocab = int(meta.get(f"{arch}.vocab_size", embed.shape[0]))

    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        context_length=int(need("context_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
    )
    if arch == "gemma3":
        window = meta.get(f"{arch}.attention.sliding_window")
        scaling = 1.0
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        return ModelConfig(
            **common,
            sliding_layers=tuple((i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(layers)),
            sliding_window=int(window) if window is not None else None,
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
            rope_global_scaling=scaling,
            # Gemma 3 scales queries by query_pre_attn_scalar**-0.5, which equals head_dim in
            # every released size; GGUF does not store it.
            attention_scale=head_dim**-0.5,
            scale_embeddings=True,
            qk_norm=True,
            sandwich_norms=True,
            activation="gelu_tanh",
        )
    raise AssertionError(f"unhandled architecture {arch}")  # guarded by SUPPORTED_ARCHITECTURES


def _optional_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def gguf_tensor_names(config: ModelConfig) -> Iterator[tuple[str, str]]:
    """(GGUF name, our state-dict name) for every tensor the decoder needs."""
    yield "token_embd.weight", "embed_tokens.weight"
    yield "output_norm.weight", "norm.weight"
    if not config.tie_word_embeddings:
        yield "output.weight", "lm_head.weight"
    for i in range(config.num_layers):
        for suffix, ours in _LAYER_TENSORS.items():
            if suffix in ("attn_q_norm", "attn_k_norm") and not config.qk_norm:
                continue
            if suffix in ("post_attention_norm", "post_ffw_norm") and not config.sandwich_norms:
                continue
            yield f"blk.{i}.{suffix}.weight", f"layers.{i}.{ours}.weight"
        # llama.cpp calls the norm before the MLP ffn_norm; it is our pre-MLP norm.
        pre_mlp = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
        yield f"blk.{i}.ffn_norm.weight", f"layers.{i}.{pre_mlp}.weight"


def state_dict_from_gguf(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Dequantized tensors under our names, in `dtype` (norms stay float32).

    Gemma's norm weights are stored by llama.cpp already as the effective multiplier
    (1 + w), which is what our RMSNorm uses, so they are taken as they are.
    """
    state: dict[str, torch.Tensor] = {}
    names = list(gguf_tensor_names(config))
    for done, (gguf_name, ours) in enumerate(names, start=1):
        if gguf_name not in gguf.tensors:
            raise ModelFileError(gguf.path, f"tensor {gguf_name} is missing")
        tensor = gguf.dequantize(gguf_name)
        state[ours] = tensor if tensor.ndim == 1 else tensor.to(dtype)
        if progress is not None:
            progress(done, len(names))
    return state
