"""A tiny random Gemma 3 written as GGUF with the gguf package's writer.

It follows llama.cpp's tensor names and metadata keys, carries a real (small)
SentencePiece-style vocabulary with byte fallback, and generates in milliseconds:
the model for tests that exercise the server rather than the model's numbers.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 2, 2, 1, 16, 64
WORDS = ["▁", "e", "t", "a", "o", "n", "▁the", "▁a", "▁of", "▁to", "in", "er", "▁is", "▁and", "ing", "."]


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    types = [3] * len(specials) + [6] * 256 + [1] * len(WORDS)
    scores = [-1000.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(WORDS))]
    return tokens, scores, types


def write_tiny_gemma3(path: Path, seed: int = 0, ffn: int = FFN) -> Path:
    """`ffn` widens the MLP: the same vocabulary and shapes elsewhere, a step that takes longer."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma3")
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm(size: int) -> np.ndarray:  # llama.cpp stores Gemma norms as 1 + w
        return (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    writer.add_tensor("output_norm.weight", norm(HIDDEN))
    for i in range(LAYERS):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_q.weight", weight(HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_k.weight", weight(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_v.weight", weight(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_output.weight", weight(HIDDEN, HEADS * HEAD_DIM))
        writer.add_tensor(f"{block}.attn_q_norm.weight", norm(HEAD_DIM))
        writer.add_tensor(f"{block}.attn_k_norm.weight", norm(HEAD_DIM))
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            writer.add_tensor(f"{block}.{name}.weight", norm(HIDDEN))
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(ffn, HIDDEN))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(ffn, HIDDEN))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(HIDDEN, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
