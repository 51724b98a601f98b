"""BERT-family encoders from GGUF files as llama.cpp's converter writes them.

The converter keeps BERT's shapes under its own tensor names, records the pooling in
`bert.pooling_type` (1 mean, 2 cls, 3 last, 4 rank) and stores the WordPiece vocabulary in
"phantom space" form: a word-initial piece as "▁piece", a continuation without its "##",
bracketed specials as they are. The vocabulary is turned back into WordPiece here, with BERT's
normalizer (lowercasing as `tokenizer.ggml.normalizer.lowercase` says) and its [CLS] … [SEP]
template. Embeddings are normalized, as llama.cpp's server returns them; a one-label reranker's
logit goes through a sigmoid, as sentence-transformers' CrossEncoder scores it. The file does not
say which GELU the model was trained with: BERT's own (erf) is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llorch.errors import ModelFileError
from llorch.models.encoder import Encoder
from llorch.models.encoder_config import POOLINGS, EncoderConfig
from llorch.weights import limits
from llorch.weights.encoder_model import LoadedEncoder
from llorch.weights.gguf import GGUFFile
from llorch.weights.limits import bounded_int, finite_float
from llorch.weights.tokenizer import Tokenizer, check_vocabulary

POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's LLAMA_POOLING_TYPE_* (0: none)
PHANTOM_SPACE = "\u2581"
CONTROL = 3  # GGUF token type of special tokens
TENSORS = {"token_embd": "word_embeddings", "position_embd": "position_embeddings",
           "token_types": "token_type_embeddings", "token_embd_norm": "embedding_norm", "cls": "pooler",
           "cls.output": "classifier"}
LAYER_TENSORS = {"attn_q": "query", "attn_k": "key", "attn_v": "value", "attn_output": "attention_out",
                 "attn_output_norm": "attention_norm", "ffn_up": "intermediate", "ffn_down": "output",
                 "layer_output_norm": "output_norm"}


def load_gguf_encoder(path: Path, device: torch.device, dtype: torch.dtype, pooling: str | None = None
                      ) -> LoadedEncoder:
    gguf = GGUFFile(path)
    config = gguf_encoder_config(gguf, pooling)
    tokenizer = wordpiece_tokenizer(gguf.metadata, path)
    if tokenizer.backend.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise ModelFileError(path, f"the vocabulary holds more tokens than the embedding's {config.vocab_size}")
    with torch.device("meta"):
        model = Encoder(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    names: dict[str, str] = {}
    for name, info in gguf.tensors.items():
        ours = _our_name(name)
        if ours is None:
            raise ModelFileError(path, f"has tensor {name}, which a BERT encoder does not have")
        if ours.startswith(("pooler.", "classifier.")) and config.pooling != "rank":
            continue
        shape = info.shape
        if ours == "position_embeddings.weight" and len(shape) == 2 and shape[0] >= config.context_length:
            shape = (config.context_length, shape[1])
        if ours not in expected:
            raise ModelFileError(path, f"has tensor {name}, which the metadata does not describe")
        if tuple(shape) != expected[ours]:
            raise ModelFileError(path, f"tensor {name} has shape {tuple(info.shape)}, the metadata implies "
                                 f"{expected[ours]}")
        names[name] = ours
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        raise ModelFileError(path, f"tensor for {missing[0]} is missing")
    state = {}
    for name, ours in names.items():
        tensor = gguf.dequantize(name)
        state[ours] = (tensor[: config.context_length] if ours == "position_embeddings.weight" else tensor).to(dtype)
    model.load_state_dict(state, assign=True, strict=True)
    model.fuse_projections()
    name = str(gguf.metadata.get("general.name") or path.stem)[: limits.MAX_NAME_CHARS]
    return LoadedEncoder(name, path, config, model.to(device).eval().requires_grad_(False), tokenizer, dtype)


def gguf_encoder_config(gguf: GGUFFile, pooling: str | None) -> EncoderConfig:
    meta, path = gguf.metadata, gguf.path

    def count(key: str, low: int, high: int) -> int:
        return bounded_int(meta.get(f"bert.{key}"), f"metadata bert.{key}", low, high, path)

    if meta.get("bert.attention.causal", False):
        raise ModelFileError(path, "bert.attention.causal is true: a causal BERT is not supported")
    hidden, heads = count("embedding_length", 1, limits.MAX_WIDTH), count("attention.head_count", 1, limits.MAX_HEADS)
    if hidden % heads:
        raise ModelFileError(path, f"embedding_length {hidden} does not split into {heads} attention heads")
    labels = gguf.tensors["cls.output.weight"].shape[0] if "cls.output.weight" in gguf.tensors else 0
    if labels and "cls.weight" not in gguf.tensors:
        raise ModelFileError(path, "is a BERT classifier without its pooler (cls.weight), which llama.cpp's converter "
                             "drops from BERT: its scores cannot be computed; serve the Hugging Face directory")
    kind = meta.get("bert.pooling_type")
    found = POOLING_TYPES.get(kind) if isinstance(kind, int) else None
    chosen = pooling or found
    if chosen is None:
        raise ModelFileError(path, f"bert.pooling_type {meta.get('bert.pooling_type')!r} names no pooling; "
                             "give --pooling mean|cls|last")
    if chosen not in POOLINGS or (chosen == "rank") != (found == "rank"):
        raise ModelFileError(path, f"--pooling {chosen} does not fit this model (its file says {found})")
    embed, types = gguf.tensors.get("token_embd.weight"), gguf.tensors.get("token_types.weight")
    if embed is None or types is None or len(embed.shape) != 2 or len(types.shape) != 2:
        raise ModelFileError(path, "tensors token_embd.weight and token_types.weight must be 2-D and present")
    return EncoderConfig(
        architecture="bert", vocab_size=bounded_int(embed.shape[0], "vocabulary", 1, limits.MAX_VOCAB, path),
        hidden_size=hidden, num_layers=count("block_count", 1, limits.MAX_LAYERS), num_heads=heads,
        intermediate_size=count("feed_forward_length", 1, limits.MAX_WIDTH),
        context_length=count("context_length", 1, limits.MAX_CONTEXT),
        type_vocab_size=bounded_int(types.shape[0], "token types", 1, 1 << 10, path),
        layer_norm_eps=finite_float(meta.get("bert.attention.layer_norm_epsilon", 1e-12), "layer_norm_epsilon", path),
        activation="gelu", pooling=chosen, normalize=chosen != "rank", num_labels=labels if chosen == "rank" else 0,
        score_activation="sigmoid" if labels == 1 else "identity")


def _our_name(name: str) -> str | None:
    stem, _, leaf = name.rpartition(".")
    if stem.startswith("blk."):
        _, number, part = stem.split(".", 2)
        return f"layers.{number}.{LAYER_TENSORS[part]}.{leaf}" if part in LAYER_TENSORS and number.isdigit() else None
    return f"{TENSORS[stem]}.{leaf}" if stem in TENSORS else None


def wordpiece_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """BERT's WordPiece tokenizer from the converter's phantom-space vocabulary."""
    if meta.get("tokenizer.ggml.model") != "bert":
        raise ModelFileError(path, f"tokenizer kind {meta.get('tokenizer.ggml.model')!r} is not BERT's WordPiece")
    tokens = meta.get("tokenizer.ggml.tokens")
    check_vocabulary(tokens, path)
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [])]
    if types and len(types) != len(tokens):
        raise ModelFileError(path, f"tokenizer.ggml.token_type holds {len(types)} values for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        piece = token if token.startswith("[") and token.endswith("]") else (
            token[1:] if token.startswith(PHANTOM_SPACE) else f"##{token}")
        if vocab.setdefault(piece, index) != index:
            raise ModelFileError(path, f"tokens {vocab[piece]} and {index} are both the WordPiece {piece!r}")

    def special(key: str) -> tuple[str, int]:
        index = meta.get(f"tokenizer.ggml.{key}")
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise ModelFileError(path, f"tokenizer.ggml.{key} is not a token id")
        return tokens[index], index

    (cls, cls_id), (sep, sep_id), (unk, _) = special("bos_token_id"), special("seperator_token_id"), special(
        "unknown_token_id")
    backend = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                    lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, cls_id), (sep, sep_id)])
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == CONTROL])
    return Tokenizer.around(backend, None, set())
