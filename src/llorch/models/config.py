"""ModelConfig: everything the decoder needs to know about a model, as plain data.

A config is built by the weights layer from a file's own metadata (GGUF keys or
config.json); nothing here hard-codes a model size. Per-architecture differences
are named fields with a documented meaning, so one decoder serves the family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The families one decoder serves. Mistral is Llama with a sliding window, so it is
# "llama" here, as in GGUF files.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    context_length: int
    rope_theta: float
    # Layers marked True attend only to the last `sliding_window` positions and use
    # `rope_local_theta`; the others attend to everything with `rope_theta`.
    sliding_layers: tuple[bool, ...]
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    # Linear RoPE scaling applied to the global (non-sliding) layers only, as Gemma 3 does.
    rope_global_scaling: float = 1.0
    # Per-frequency divisors of the global layers' RoPE inverse frequencies (head_dim / 2 of
    # them), as llama.cpp's rope_freqs tensor stores them: Llama 3.1's "llama3" scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    # Attention scores are multiplied by attention_scale (default 1/sqrt(head_dim)).
    attention_scale: float | None = None
    # Gemma: token embeddings are multiplied by sqrt(hidden_size) before the first layer.
    scale_embeddings: bool = False
    # Qwen3 / Gemma 3: RMSNorm over each query and key head before RoPE.
    qk_norm: bool = False
    # Qwen2: biases on the q/k/v projections. Llama's attention_bias also puts one on o_proj.
    qkv_bias: bool = False
    o_bias: bool = False
    # Gemma 2/3: extra norms after attention and after the MLP, before each residual add.
    sandwich_norms: bool = False
    # MLP activation on the gate projection: "silu" (Llama) or "gelu_tanh" (Gemma).
    activation: str = "silu"
    tie_word_embeddings: bool = True
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5
