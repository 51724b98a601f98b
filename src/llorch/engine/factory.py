"""Building an engine: the one place a model runner and an engine are assembled from an EngineConfig.

The policies that size them live here too: the compute path (the C step, loaded without
torch, for GGUF files on the CPU in float32; torch otherwise), the compute dtype, whether
GGUF weights stay quantized, the KV pool's budget and the chat template. Before any of
that, the model proves it computes: a forward over a short text must give finite
logits (a config.json can hold finite, valid-looking numbers, a rope_theta of 1e-300,
that make every logit NaN).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llorch.device import torch_device
from llorch.engine.config import DEFAULT_CPU_KV_MB, DEFAULT_CUDA_KV_FRACTION, PROBE_TEXT, EngineConfig, resolve_dtype
from llorch.engine.core import EngineCore
from llorch.engine.engine import Engine
from llorch.engine.grammar import Grammars
from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.kv.pool import BLOCK_SIZE, HOST_KV_DTYPE, allocate_kv, bytes_per_block
from llorch.engine.model_kinds import decoder_kind, holds_encoder, rank_tokens
from llorch.engine.prepare import FrontDoor
from llorch.engine.runner import ModelRunner
from llorch.engine.scheduler import Scheduler
from llorch.engine.scoring import Pool, last_token_pool, rank_pool
from llorch.engine.speculative import SPECULATIVE_MAX_ROWS, NgramSpeculation
from llorch.engine.telemetry import Telemetry
from llorch.engine.views import EmbeddingShape
from llorch.errors import StartupError
from llorch.kernels.build import KernelUnavailable
from llorch.kernels.build import in_use as kernels_in_use
from llorch.kernels.build import library as kernel_library
from llorch.kernels.build import threads as kernel_threads
from llorch.memory import release_freed_memory
from llorch.models.step_layout import ChunkSlots, row_layout
from llorch.weights.chat_families import family_for
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.default_model import default_model_path
from llorch.weights.model_source import LoadedModel
from llorch.weights.native_loader import load_native
from llorch.weights.template_files import read_template_file
from llorch.weights.template_sandbox import shared_sandbox
from llorch.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from llorch.engine.draft import DraftSpeculation

log = logging.getLogger("llorch.engine")

PROBE_TOKENS = 16


def keeps_quantized(config: EngineConfig, device: str) -> bool:
    """GGUF weights stay quantized for the CPU kernels, unless told otherwise or they cannot build here."""
    if device != "cpu" or config.dequantize:
        return False
    try:
        kernel_library()
    except KernelUnavailable as exc:
        log.warning("int8 kernels unavailable, GGUF weights will be dequantized", extra={"reason": str(exc)})
        return False
    return True


def load_decoder(config: EngineConfig, path: Path, device: str, kind: str,
                 progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """A GGUF file on the CPU in float32 computes in the C step and loads without torch; anything else
    (a directory, CUDA, another dtype, dequantized weights, an embedding model's hidden states) with torch."""
    if config.c_step_on(device) and not path.is_dir() and kind != "embed":
        try:  # the kernels are waited for once the file is converted: a first start builds both at once
            return load_native(path, progress)
        except KernelUnavailable as exc:
            log.warning("int8 kernels unavailable, GGUF weights will be dequantized", extra={"reason": str(exc)})
            config = replace(config, dequantize=True)
    from llorch.weights.loader import load_model

    on = torch_device(device)
    return load_model(path, on, resolve_dtype(config.dtype, on), progress=progress,
                      keep_quantized=kind != "embed" and keeps_quantized(config, device),
                      hidden_states=kind == "embed")  # hidden states come from torch: no kernels to build


def kv_dtype(model: LoadedModel) -> Any:
    """What the model's KV pool holds: float16 host arrays for the C step, else the compute dtype."""
    return HOST_KV_DTYPE if model.native is not None else model.dtype


def kv_pool_bytes(config: EngineConfig, model: LoadedModel, device: str, ctx_size: int) -> int:
    """The KV pool's budget: the operator's, else a default for the device capped at max_running
    full contexts (plus the padding block)."""
    block = bytes_per_block(model.config, kv_dtype(model))
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    else:
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            budget = int(free * DEFAULT_CUDA_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_MB * 2**20
        budget = min(budget, (config.max_running * -(-ctx_size // BLOCK_SIZE) + 1) * block)
    if budget < 2 * block:
        raise StartupError(f"--kv-cache-mb {budget / 2**20:g} is smaller than two KV blocks of this model "
                           f"({2 * block / 2**20:.2f} MB)")
    return budget


def model_runner(loaded: LoadedModel, device: str, pool_bytes: int) -> ModelRunner:
    """The C step's runner on host arrays where it computes the model, else torch's on `device`."""
    native = loaded.native
    if native is not None:
        return ModelRunner(native, None, HOST_KV_DTYPE, pool_bytes)
    return ModelRunner(loaded.model, torch_device(device), loaded.dtype, pool_bytes)


def load_chat_template(path: str | None, loaded: LoadedModel) -> ChatTemplate:
    """The operator's template file, else the model's own, else its family's (chat_families.py)."""
    source, name = loaded.chat_template, "model"
    if path:
        source, name = read_template_file(Path(path)), "file"
    tokenizer = loaded.tokenizer
    if source is None:
        family = family_for(loaded.config.architecture, tokenizer.has_token)
        source, name = family.template, f"family:{family.name}"
    log.info("chat template", extra={"chat_template": name})
    bos = tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.eos_token_id
    try:
        return ChatTemplate(source, bos, tokenizer.token_text(eos) if eos is not None else "", name)
    except ChatTemplateError as exc:
        raise StartupError(f"{path or loaded.path}: {exc}") from exc


def probe_logits(loaded: LoadedModel, ids: list[int], device: str, threads: int | None = None) -> np.ndarray:
    """Every row's logits (float32) of a forward over `ids` on a cache of its own (the C step on `threads`,
    by default all of the step's)."""
    native = loaded.native
    if native is not None:
        cache = allocate_kv(loaded.config, len(ids), None, None)
        layout = row_layout([ChunkSlots(0, len(ids), np.arange(len(ids), dtype=np.int64))])
        return native.forward(ids, layout, [(layer.keys, layer.values) for layer in cache], threads or kernel_threads())
    import torch

    from llorch.models.step_batch import contiguous_step

    on = torch_device(device)
    step = contiguous_step(loaded.config, 0, len(ids), on, last_only=False)
    cache = allocate_kv(loaded.config, len(ids), loaded.dtype, on, zeroed=True)
    with torch.inference_mode():
        return loaded.model(torch.tensor(ids, dtype=torch.long, device=on), step, cache).float().cpu().numpy()


def prove_finite_logits(loaded: LoadedModel, device: str, threads: int | None = None) -> None:
    """A forward over PROBE_TEXT on a cache of its own (on `threads` of the C step's, by default all);
    StartupError when any of its logits is NaN or infinite.

    A model whose numbers overflow would otherwise load, then sample from NaN and answer
    every request for log-probabilities with numbers JSON cannot carry.
    """
    ids = loaded.tokenizer.encode(PROBE_TEXT)[:PROBE_TOKENS]
    if not ids:
        return
    logits = probe_logits(loaded, ids, device, threads)
    finite = np.isfinite(logits)
    if bool(finite.all()):
        return
    kinds = [name for name, found in (("NaN", np.isnan(logits).any()), ("infinite", np.isinf(logits).any()))
             if bool(found)]
    first = int(np.flatnonzero(~finite.all(axis=-1))[0])
    raise StartupError(f"{loaded.path}: the model computes {' and '.join(kinds)} logits on a test text of {len(ids)} "
                       f"tokens (from token {first} on): its weights or its configuration (rope_theta, rope_scaling, "
                       "a norm epsilon, the compute dtype) overflow; it cannot be served")


def check_speculative_flags(config: EngineConfig) -> None:
    """Flags that contradict each other fail before anything is loaded."""
    if config.speculative == "draft" and not config.draft_model:
        raise StartupError("--speculative draft needs --draft-model PATH")
    if config.draft_model and config.speculative not in (None, "draft"):
        raise StartupError(f"--draft-model is used by --speculative draft only, not --speculative {config.speculative}")


def speculation_mode(config: EngineConfig, loaded: LoadedModel) -> str:
    """Speculative decoding is on by default where a row's logits have the same bits however its
    tokens are stepped (the C step): only there can verification never change a token."""
    invariant = loaded.native is not None
    if config.speculative is None:
        return "draft" if config.draft_model else "ngram" if invariant else "off"
    if config.speculative != "off" and not invariant:
        log.warning("speculative decoding on a compute path that is not batch-invariant: a verified token "
                    "can differ from step-by-step decoding where two logits tie within float rounding")
    return config.speculative


def draft_speculation(config: EngineConfig, target: ModelRunner, tokenizer: Tokenizer,
                      device: str) -> DraftSpeculation:
    """The draft model, proven to compute and to share the target's vocabulary, with a KV pool of as many
    tokens as the target's."""
    from llorch.engine.draft import DraftSpeculation

    assert config.draft_model is not None
    draft = load_decoder(config, Path(config.draft_model), device, "generate")
    ours, theirs = tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
    if ours != theirs:
        differing = len(set(ours.items()) ^ set(theirs.items()))
        raise StartupError(f"{draft.path}: the draft model's vocabulary ({len(theirs)} tokens) is not the served "
                           f"model's ({len(ours)} tokens; {differing} entries differ): its guesses would be other "
                           "tokens")
    prove_finite_logits(draft, device)
    runner = model_runner(draft, device, target.kv.num_blocks * bytes_per_block(draft.config, kv_dtype(draft)))
    log.info("draft model loaded", extra={"model": draft.name, "path": str(draft.path),
                                          "weights": "gguf blocks" if draft.quantized else "dense"})
    return DraftSpeculation(runner, target.config.vocab_size, config.speculative_tokens, SPECULATIVE_MAX_ROWS)


def build_engine(config: EngineConfig, device: str | torch.device = "cpu", *, loaded: LoadedModel | None = None,
                 telemetry: Telemetry | None = None, progress: Callable[[int, int], None] | None = None,
                 probe_threads: int | None = None) -> Engine:
    """Load the model (unless `loaded` is given) and assemble its runner and engine, not yet started;
    `probe_threads`: the C step's threads for the finite-logits probe (default: all of them)."""
    device = str(device)
    check_speculative_flags(config)
    telemetry = telemetry or Telemetry()
    path = Path(config.model) if config.model else None
    if loaded is None and path is not None and holds_encoder(path):
        from llorch.engine.encoder_engine import encoder_engine  # encoders compute with torch; decoders may not

        return encoder_engine(config, path, device, telemetry)
    kind, normalize = decoder_kind(config, path)
    if kind != "generate" and (config.draft_model or config.speculative not in (None, "off")):
        raise StartupError(f"--pooling {config.pooling or 'from the model'}: a {kind} model reads prompts only; "
                           "speculative decoding does not apply")
    config = replace(config, speculative="off") if kind != "generate" else config
    config = config.with_limits(kind)
    shared_sandbox().start()  # the chat template's render process starts while the model loads
    if loaded is None:
        loaded = load_decoder(config, path or default_model_path(), device, kind, progress)
    prove_finite_logits(loaded, device, probe_threads)
    release_freed_memory()  # before the KV pool is allocated, or it would reuse (and keep) the freed pages
    ctx_size = config.ctx_size or loaded.config.context_length
    if not 0 < ctx_size <= loaded.config.context_length:
        source = "--ctx-size" if config.ctx_size else "the model's context_length"
        raise StartupError(f"{source} {ctx_size} is outside 1..{loaded.config.context_length}")
    pool_bytes = kv_pool_bytes(config, loaded, device, ctx_size)
    runner = model_runner(loaded, device, pool_bytes)
    speculative = speculation_mode(config, loaded)
    speculation = (draft_speculation(config, runner, loaded.tokenizer, device) if speculative == "draft"
                   else NgramSpeculation(config.speculative_tokens, SPECULATIVE_MAX_ROWS) if speculative == "ngram"
                   else None)
    config = replace(config, ctx_size=ctx_size, speculative=speculative)
    engine = decoder_engine(runner, loaded.tokenizer, config, load_chat_template(config.chat_template_file, loaded),
                            speculation, telemetry, model_name=loaded.name, model_id=loaded.model_id,
                            model_path=loaded.path, pool=rank_pool(rank_tokens(loaded)) if kind == "rerank"
                            else last_token_pool(normalize) if kind == "embed" else None, kind=kind,
                            embedding=EmbeddingShape(loaded.config.hidden_size, normalize) if kind == "embed" else None)
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    engine.telemetry.model.info({"model": loaded.name, "model_id": loaded.model_id, "device": device,
                                 "dtype": dtype_name, "kind": kind})
    log.info("model loaded", extra={"model": loaded.name, "path": str(loaded.path), "device": device,
                                    "dtype": dtype_name, "threads": kernel_threads(), "kind": kind,
                                    "weights": "gguf blocks" if loaded.quantized else "dense",
                                    "kernels": kernels_in_use() if loaded.native is not None else None,
                                    "kv_pool_tokens": runner.kv.tokens, "kv_pool_bytes": runner.kv.bytes,
                                    "speculative": speculative, "speculative_tokens": config.speculative_tokens})
    return engine


def decoder_engine(runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig, chat_template: ChatTemplate | None,
                   speculation: NgramSpeculation | None, telemetry: Telemetry, *, model_name: str, model_id: str,
                   model_path: Path | None = None, pool: Pool | None = None, kind: str = "generate",
                   embedding: EmbeddingShape | None = None) -> Engine:
    """A generating engine around a runner (a reranker's or embedding model's, given how it pools): its KV
    blocks, scheduler, core and front door."""
    assert config.ctx_size is not None and config.max_running is not None and config.max_batch_tokens is not None
    blocks = BlockAllocator(runner.kv.num_blocks, runner.kv.block_size, config.prefix_caching)
    scheduler = Scheduler(blocks, config.max_running, config.max_batch_tokens, tokenizer.eos_token_ids, speculation)
    grammars = Grammars(tokenizer, runner.config.vocab_size)
    if config.grammar_at_start:  # its build holds Python's lock for about a second: here rather than mid-serving
        grammars.prepare()
    front = FrontDoor(tokenizer, chat_template, config.ctx_size, runner.kv.tokens, config.max_prompt_tokens,
                      grammars, runner.config.vocab_size, kind=kind)
    return Engine(EngineCore(runner, scheduler, telemetry, pool), front, tokenizer, config,
                  model_name=model_name, model_id=model_id, telemetry=telemetry, model_path=model_path,
                  embedding=embedding)


