"""Every weight a decoder of a config takes, with its shape, from the config alone (no torch).

The loader checks a file's tensors against these before it reads one (a header may claim
anything). They are models/decoder.py's state-dict names; a test holds the two together.
"""

from __future__ import annotations

from llorch.models.config import ModelConfig


def decoder_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    cfg = config
    hidden, head = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * head, cfg.num_kv_heads * head
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        layer = f"layers.{i}."
        attention = {"q_proj": (q_rows, hidden), "k_proj": (kv_rows, hidden), "v_proj": (kv_rows, hidden),
                     "o_proj": (hidden, q_rows)}
        for name, shape in attention.items():
            shapes[f"{layer}self_attn.{name}.weight"] = shape
            if (cfg.qkv_bias and name != "o_proj") or (cfg.o_bias and name == "o_proj"):
                shapes[f"{layer}self_attn.{name}.bias"] = shape[:1]
        if cfg.qk_norm:
            shapes[f"{layer}self_attn.q_norm.weight"] = shapes[f"{layer}self_attn.k_norm.weight"] = (head,)
        shapes[f"{layer}mlp.gate_proj.weight"] = shapes[f"{layer}mlp.up_proj.weight"] = (cfg.intermediate_size, hidden)
        shapes[f"{layer}mlp.down_proj.weight"] = (hidden, cfg.intermediate_size)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        shapes.update((f"{layer}{norm}.weight", (hidden,)) for norm in norms)
    shapes["norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes
