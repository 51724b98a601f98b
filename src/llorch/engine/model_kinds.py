"""What a model is served for, and the engines of the models that pool instead of generating.

A model directory or file holds a generating decoder or a BERT-family encoder (an embedding
model or a cross-encoder reranker). A decoder generates, or with a pooling (from its
sentence-transformers modules or --pooling) embeds a text by its last token's hidden state
or reranks a pair by its yes/no logits; those run through the generating engine (factory.py).
An encoder gets an engine of its own core (encoder_core.py) behind the same shell.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from llorch.engine.config import PROBE_TEXT, EngineConfig, resolve_dtype
from llorch.engine.encoder_core import EncoderCore, EncoderRunner
from llorch.engine.engine import Engine
from llorch.engine.prepare import FrontDoor
from llorch.engine.telemetry import Telemetry
from llorch.engine.views import EmbeddingShape
from llorch.errors import StartupError
from llorch.weights.encoder_gguf import ENCODER_ARCHITECTURES, load_gguf_encoder
from llorch.weights.encoder_model import is_encoder, load_encoder, sentence_modules
from llorch.weights.gguf import leading_architecture
from llorch.weights.loader import LoadedModel

log = logging.getLogger("llorch.engine")


def holds_encoder(path: Path) -> bool:
    """Whether a model file or directory holds an embedding or rerank encoder (else: a generating decoder)."""
    if path.is_dir():
        return is_encoder(path)
    return path.is_file() and leading_architecture(path) in ENCODER_ARCHITECTURES


def decoder_kind(config: EngineConfig, path: Path | None) -> tuple[str, bool]:
    """What a generating model is served for, and whether its vectors are normalized: generation; rerank
    (--pooling rank); embeddings of its last token's hidden state (--pooling last, or a sentence-transformers
    directory whose pooling module says so, Qwen3-Embedding's layout)."""
    files = sentence_modules(path) if path is not None and path.is_dir() else None
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


def encoder_engine(config: EngineConfig, path: Path, device: torch.device, telemetry: Telemetry) -> Engine:
    """An embedding or rerank model's engine: the encoder, its core, and a front door without chat or grammar."""
    if config.speculative not in (None, "off") or config.draft_model:
        raise StartupError(f"{path}: speculative decoding is for generation; this is an embedding or rerank model")
    dtype = resolve_dtype(config.dtype, device)
    loaded = (load_encoder(path, device, dtype, config.pooling) if path.is_dir()
              else load_gguf_encoder(path, device, dtype, config.pooling))
    ctx_size = config.ctx_size or loaded.config.context_length
    if not 0 < ctx_size <= loaded.config.context_length:
        source = "--ctx-size" if config.ctx_size else "the model's context"
        raise StartupError(f"{source} {ctx_size} is outside 1..{loaded.config.context_length}")
    config = replace(config.with_limits(loaded.kind), ctx_size=ctx_size, speculative="off")
    assert config.max_running is not None and config.max_batch_tokens is not None
    runner = EncoderRunner(loaded.model, device, loaded.dtype)
    # The start-up proof that it computes (and its first, slowest forward): a probe text must pool to finite values.
    probe, types, _ = loaded.tokenizer.encode_for_pooling(PROBE_TEXT, PROBE_TEXT if loaded.kind == "rerank" else None,
                                                          ctx_size)
    with torch.inference_mode():
        values = loaded.model(torch.tensor(probe, device=device), torch.tensor(types, device=device), [len(probe)])
    if not bool(torch.isfinite(values).all()):
        raise StartupError(f"{path}: the model computes values that are not finite on a test text: its weights or "
                           "its configuration (a norm epsilon, the compute dtype) overflow; it cannot be served")
    core = EncoderCore(runner, config.max_running, config.max_batch_tokens, telemetry)
    front = FrontDoor(loaded.tokenizer, None, ctx_size, ctx_size, config.max_prompt_tokens, None,
                      loaded.config.vocab_size, kind=loaded.kind)
    shape = loaded.config
    embedding = EmbeddingShape(shape.dimensions, shape.normalize, shape.matryoshka_dimensions) if (
        loaded.kind == "embed") else None
    engine = Engine(core, front, loaded.tokenizer, config, model_name=loaded.name, model_id=loaded.model_id,
                    telemetry=telemetry, model_path=path, embedding=embedding)
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    telemetry.model.info({"model": loaded.name, "model_id": loaded.model_id, "device": str(device),
                          "dtype": dtype_name, "kind": loaded.kind})
    log.info("model loaded", extra={"model": loaded.name, "path": str(path), "device": str(device), "dtype": dtype_name,
                                    "threads": torch.get_num_threads(), "kind": loaded.kind,
                                    "pooling": loaded.config.pooling, "dimensions": loaded.config.dimensions,
                                    "context": ctx_size})
    return engine
