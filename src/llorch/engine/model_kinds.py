"""What a model is served for, and the engines of the models that pool instead of generating.

A model directory or file holds a generating decoder or a BERT-family encoder (an embedding
model or a cross-encoder reranker). A decoder generates, or with a pooling (from its
sentence-transformers modules or --pooling) embeds a text by its last token's hidden state
or reranks a pair by its yes/no logits; those run through the generating engine (factory.py).
An encoder gets an engine of its own core behind the same shell (encoder_engine.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from llorch.engine.config import EngineConfig
from llorch.errors import StartupError
from llorch.models.encoder_config import ENCODER_ARCHITECTURES
from llorch.weights.gguf import leading_architecture
from llorch.weights.model_source import LoadedModel

log = logging.getLogger("llorch.engine")


def holds_encoder(path: Path) -> bool:
    """Whether a model file or directory holds an embedding or rerank encoder (else: a generating decoder)."""
    if path.is_dir():
        from llorch.weights.encoder_model import is_encoder  # the encoder loader imports torch: only for directories

        return is_encoder(path)
    return path.is_file() and leading_architecture(path) in ENCODER_ARCHITECTURES


def decoder_kind(config: EngineConfig, path: Path | None) -> tuple[str, bool]:
    """What a generating model is served for, and whether its vectors are normalized: generation; rerank
    (--pooling rank); embeddings of its last token's hidden state (--pooling last, or a sentence-transformers
    directory whose pooling module says so, Qwen3-Embedding's layout)."""
    files = None
    if path is not None and path.is_dir():
        from llorch.weights.encoder_model import sentence_modules  # as in holds_encoder

        files = sentence_modules(path)
    pooling = config.pooling or (files[0] if files else None)
    if pooling is None:
        return "generate", False
    if pooling == "rank":
        return "rerank", False
    if pooling != "last":
        raise StartupError(f"pooling {pooling}: a generating model embeds by its last token (--pooling last) or "
                           "reranks (--pooling rank); mean and cls pooling of a decoder are not supported yet")
    return "embed", files[1] if files else True


def rank_tokens(loaded: LoadedModel) -> tuple[int, int]:
    """A decoder reranker's "no" and "yes" tokens (Qwen3-Reranker's answer words), from its vocabulary."""
    vocab = loaded.tokenizer.backend.get_vocab()
    if "no" not in vocab or "yes" not in vocab:
        raise StartupError(f"{loaded.path}: --pooling rank scores a pair by the tokens 'yes' and 'no', which this "
                           "model's vocabulary does not hold")
    return vocab["no"], vocab["yes"]
