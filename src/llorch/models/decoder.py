"""The decoder-only transformer of the Llama family, as plain nn.Modules.

One decoder for every architecture; the differences are switches in ModelConfig
(qk_norm, sandwich_norms, sliding_layers, activation, ...). The model never reads
files: the weights layer builds the config and fills the state dict.

Norm weights are the effective multipliers (x * w). Checkpoints that store them as
offsets from one (Gemma's `1 + w`) are converted by the weights layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llorch.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalize in float32 whatever the compute dtype, as the references do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).type_as(x)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, scaling: float, freq_factors: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin of the rotary embedding for the given absolute positions, shape [T, head_dim].

    `scaling` divides the positions (linear scaling); `freq_factors` divides each inverse
    frequency (Llama 3.1's scaling, stored that way by llama.cpp).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    freqs = (positions.float() / scaling)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


class LayerKV:
    """One layer's key/value cache for one sequence: [1, kv_heads, capacity, head_dim]."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys = keys
        self.values = values


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.config = config
        self.sliding = sliding
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        factors = None
        if sliding and config.rope_local_theta is not None:
            self.rope_theta, self.rope_scaling = config.rope_local_theta, 1.0
        else:
            self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_global_scaling
            if config.rope_freq_factors is not None:
                # Built on the CPU even when the model is built on the meta device: it comes from
                # the config, not the state dict, and moves to the worker's device with the weights.
                factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
        self.freq_factors: Tensor | None
        self.register_buffer("freq_factors", factors, persistent=False)

    def forward(self, x: Tensor, positions: Tensor, cache: LayerKV) -> Tensor:
        cfg = self.config
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, self.rope_theta, self.rope_scaling, self.freq_factors)
        cos, sin = cos[None, :, None, :].to(q.dtype), sin[None, :, None, :].to(q.dtype)
        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        v = v.transpose(1, 2)

        start, end = int(positions[0]), int(positions[-1]) + 1
        cache.keys[:, :, start:end] = k
        cache.values[:, :, start:end] = v
        # Only the keys this layer may see: the window for sliding layers, all before `end` otherwise.
        first_key = max(0, end - length - cfg.sliding_window + 1) if self._windowed else 0
        keys = cache.keys[:, :, first_key:end]
        values = cache.values[:, :, first_key:end]
        mask = None
        if length > 1:
            key_pos = torch.arange(first_key, end, device=x.device)
            delta = positions[:, None] - key_pos[None, :]
            allowed = delta >= 0
            if self._windowed:
                allowed &= delta < cfg.sliding_window
            mask = allowed[None, None]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=cfg.scale, enable_gqa=cfg.num_heads != cfg.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, cfg.num_heads * cfg.head_dim))

    @property
    def _windowed(self) -> bool:
        return self.sliding and self.config.sliding_window is not None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if config.activation == "gelu_tanh":
            self.act = lambda t: F.gelu(t, approximate="tanh")
        elif config.activation == "silu":
            self.act = F.silu
        else:
            raise ValueError(f"unknown activation {config.activation!r}")

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, sliding=config.sliding_layers[index])
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            # Gemma: post_attention_layernorm normalizes the attention output; these two wrap the MLP.
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, cache: LayerKV) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def output_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache: list[LayerKV], last_only: bool = True
    ) -> Tensor:
        """Logits for `input_ids` [1, T] at absolute `positions` [T], filling `cache`.

        With `last_only` only the last position's logits are computed: the vocabulary
        projection is the most expensive matmul, and generation needs no others.
        """
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            # The scale is rounded to the compute dtype first, as the reference does.
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, positions, layer_cache)
        if last_only:
            x = x[:, -1:]
        logits = F.linear(self.norm(x), self.output_weight())
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
