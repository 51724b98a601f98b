"""The decoder-only transformer of the Llama family, as plain nn.Modules.

One decoder for every architecture; the differences are switches in ModelConfig
(qk_norm, sandwich_norms, sliding_layers, activation, ...). The model never reads
files: the weights layer builds the config and fills the state dict.

Norm weights are the effective multipliers (x * w). Checkpoints that store them as
offsets from one (Gemma's `1 + w`) are converted by the weights layer.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llorch.models.config import ModelConfig
from llorch.models.quantized import GGUFEmbedding, GGUFLinear
from llorch.models.rope import layer_rope
from llorch.models.step_batch import StepBatch
from llorch.models.step_layout import LayerKV, RowLayout

FEW_ROWS = 32  # up to this many rows, the vocabulary projection uses the weight-major matmul


def rope_inverse_frequencies(head_dim: int, theta: float, factors: Tensor | None,
                             device: torch.device | None = None) -> Tensor:
    """theta^(-2i/head_dim), divided by the per-frequency factors when the model has them (float32)."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    return (inverse / factors if factors is not None else inverse).float().contiguous()


class CompiledStep(Protocol):
    """A whole forward step in one call (the C step, models/native.py): it replaces the module's own."""

    def forward(self, token_ids: np.ndarray, layout: RowLayout, cache: list[tuple[np.ndarray, np.ndarray]],
                threads: int, prompt_from: int | None = None) -> np.ndarray: ...


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
    inv_freq = rope_inverse_frequencies(head_dim, theta, freq_factors, positions.device)
    freqs = (positions.float() / scaling)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def concat_linears(parts: list[nn.Module]) -> nn.Module:
    """One Linear whose output is the parts' outputs side by side.

    Weights and biases are concatenated along the output rows; a part without a bias
    contributes zeros. On the meta device (a skeleton for a state dict saved already
    fused) nothing is concatenated: meta ops would pull in a second of lazy imports for
    no data.
    """
    first = parts[0]
    if not all(type(p) is nn.Linear for p in parts):
        raise TypeError("only dense Linear layers are fused")
    rows, bias = sum(p.out_features for p in parts), any(p.bias is not None for p in parts)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, rows, bias=bias)
    if first.weight.is_meta:
        return fused
    biases = [p.bias for p in parts if p.bias is not None]

    def rows_of(part: nn.Module, name: str) -> Tensor:
        tensor = part.state_dict().get(name)
        return tensor if tensor is not None else biases[0].new_zeros(part.out_features)  # a part without bias

    fused.load_state_dict({name: torch.cat([rows_of(p, name) for p in parts]) for name in fused.state_dict()},
                          assign=True)
    return fused


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
        rope = layer_rope(config, sliding)  # the C step reads the same choice (models/native.py)
        self.rope_theta, self.rope_scaling = rope.theta, rope.scaling
        factors = None
        if rope.factors is not None:
            # Built on the CPU even when the model is built on the meta device: it comes from
            # the config, not the state dict, and moves to the worker's device with the weights.
            factors = torch.tensor(rope.factors, dtype=torch.float32, device="cpu")
        self.freq_factors: Tensor | None
        self.register_buffer("freq_factors", factors, persistent=False)
        self.qkv_sizes = [config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd]
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul, once fuse_projections ran

    def fuse_projections(self) -> None:
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, batch: StepBatch, cache: LayerKV) -> Tensor:
        """Attention output for the step's N rows `x` [N, hidden], writing their keys and values to `cache`."""
        cfg = self.config
        rows = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(rows, cfg.num_heads, cfg.head_dim)
        k = k.view(rows, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(rows, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rope((self.rope_theta, self.rope_scaling, id(self.freq_factors)), lambda: rope_cos_sin(
            batch.positions, cfg.head_dim, self.rope_theta, self.rope_scaling, self.freq_factors))
        cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.keys.index_copy_(0, batch.slots, k.to(cache.keys.dtype))
        cache.values.index_copy_(0, batch.slots, v.to(cache.values.dtype))

        outputs = []
        for group in batch.groups:
            view = group.window if self._windowed and group.window is not None else group.full
            # [batch, keys, kv_heads, head_dim] -> [batch, kv_heads, keys, head_dim]
            if view.span is not None:  # consecutive slots: a view instead of a gathered copy
                keys = cache.keys[view.span[0] : view.span[1]].unsqueeze(0).transpose(1, 2)
                values = cache.values[view.span[0] : view.span[1]].unsqueeze(0).transpose(1, 2)
            else:
                keys = cache.keys[view.slots].transpose(1, 2)
                values = cache.values[view.slots].transpose(1, 2)
            # A cache kept in a narrower type than the compute dtype (the C step's float16, which the
            # tests compare this path with) is rounded to it on writing and widened on reading;
            # otherwise both are nothing.
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            queries = q[group.start : group.start + group.rows].view(
                group.batch, group.q_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=view.mask, scale=cfg.scale,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )
            outputs.append(out.transpose(1, 2).reshape(group.rows, cfg.num_heads * cfg.head_dim))
        return self.o_proj(outputs[0] if len(outputs) == 1 else torch.cat(outputs))

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
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, once fuse_projections ran

    def fuse_projections(self) -> None:
        self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


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

    def forward(self, x: Tensor, batch: StepBatch, cache: LayerKV) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Weights are always assigned by the loader; skipping the random init also spares a
        # one-second lazy import that normal_ on the meta device triggers.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The C step, when the loader attached one (models/native.py decides whether it can run).
        self.native: CompiledStep | None = None
        # An embedding model's output: the wanted rows' final (normed) hidden states instead of their logits.
        self.hidden_states = False

    def fuse_projections(self) -> None:
        """Run q/k/v and gate/up as one matmul each: fewer, larger matmuls per step (dense weights).

        Called once the weights are loaded; state-dict names change (qkv_proj, gate_up_proj).
        """
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def project_vocab(self, hidden: Tensor) -> Tensor:
        """Logits of the final hidden rows: the single most expensive matmul of a decode step."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if isinstance(head, GGUFEmbedding):
            return head.project(hidden)
        if isinstance(head, GGUFLinear):
            return head(hidden)
        # One row per sampling job: CPU BLAS runs the [vocab, hidden] x [hidden, rows] form
        # up to 3x faster than rows x weight^T for 2-16 rows, and no slower for one.
        weight = head.weight
        return (weight @ hidden.T).T if hidden.shape[0] <= FEW_ROWS else F.linear(hidden, weight)

    def forward(self, input_ids: Tensor, batch: StepBatch, cache: list[LayerKV]) -> Tensor:
        """Logits [R, vocab] for the step's `logit_rows` (every row when None), feeding `input_ids` [N].

        Only the wanted rows are projected: the vocabulary projection is the most
        expensive matmul, and generation needs one row per sampling sequence.
        """
        if self.native is not None:  # the C step reads the same memory through numpy views
            arrays = [(layer.keys.numpy(), layer.values.numpy()) for layer in cache]
            return torch.from_numpy(self.native.forward(input_ids.cpu().numpy(), batch.layout, arrays,
                                                        torch.get_num_threads()))
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            # The scale is rounded to the compute dtype first, as the reference does.
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, batch, layer_cache)
        if batch.logit_rows is not None:
            x = x[batch.logit_rows]
        if self.hidden_states:
            return self.norm(x)
        logits = self.project_vocab(self.norm(x))
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
