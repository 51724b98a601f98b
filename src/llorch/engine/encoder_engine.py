"""An embedding or rerank encoder's engine: the encoder, its core, and a front door without chat or grammar.

Apart from deciding what a model is served for (model_kinds.py), since encoders compute with
torch and a generating model on the C step does not import it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from llorch.device import torch_device
from llorch.engine.config import PROBE_TEXT, EngineConfig, resolve_dtype
from llorch.engine.encoder_core import EncoderCore, EncoderRunner
from llorch.engine.engine import Engine
from llorch.engine.prepare import FrontDoor
from llorch.engine.telemetry import Telemetry
from llorch.engine.views import EmbeddingShape
from llorch.errors import StartupError
from llorch.weights.encoder_gguf import load_gguf_encoder
from llorch.weights.encoder_model import load_encoder

log = logging.getLogger("llorch.engine")


def encoder_engine(config: EngineConfig, path: Path, device: str | torch.device, telemetry: Telemetry) -> Engine:
    """An embedding or rerank model's engine: the encoder, its core, and a front door without chat or grammar."""
    if config.speculative not in (None, "off") or config.draft_model:
        raise StartupError(f"{path}: speculative decoding is for generation; this is an embedding or rerank model")
    device = torch_device(device)
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
