"""Building an engine: the one place a model runner and an engine are assembled from an EngineConfig.

The policies that size them live here too: the compute dtype, whether GGUF weights
stay quantized (which also decides the compute path: the C step for quantized CPU
weights, torch otherwise), the KV pool's budget and the chat template. Before any of
that, the model proves it computes: a forward over a short text must give finite
logits (a config.json can hold finite, valid-looking numbers, a rope_theta of 1e-300,
that make every logit NaN).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from llorch.engine.config import DEFAULT_CPU_KV_MB, DEFAULT_CUDA_KV_FRACTION, DTYPES, EngineConfig
from llorch.engine.core import EngineCore
from llorch.engine.draft import DraftSpeculation
from llorch.engine.encoder_core import EncoderCore, EncoderRunner
from llorch.engine.engine import Engine
from llorch.engine.grammar import Grammars
from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.kv.pool import BLOCK_SIZE, allocate_kv, bytes_per_block
from llorch.engine.prepare import FrontDoor
from llorch.engine.runner import ModelRunner
from llorch.engine.scheduler import Scheduler
from llorch.engine.speculative import SPECULATIVE_MAX_ROWS, NgramSpeculation
from llorch.engine.telemetry import Telemetry
from llorch.errors import StartupError
from llorch.kernels.build import KernelUnavailable
from llorch.kernels.build import library as kernel_library
from llorch.memory import release_freed_memory
from llorch.models.step_batch import contiguous_step
from llorch.weights.chat_families import family_for
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.default_model import default_model_path
from llorch.weights.encoder_gguf import ENCODER_ARCHITECTURES, load_gguf_encoder
from llorch.weights.encoder_model import is_encoder, load_encoder
from llorch.weights.gguf import leading_architecture
from llorch.weights.loader import LoadedModel, load_model, read_template_file
from llorch.weights.tokenizer import Tokenizer

log = logging.getLogger("llorch.engine")

PROBE_TEXT = "The quick brown fox jumps over the lazy dog."  # start-up's proof that the logits are finite
PROBE_TOKENS = 16


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return DTYPES[choice]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # float32 on every CPU, measured rather than inferred from a flag: the int8 kernels compute in
    # float32 (bf16 activations were 30% slower even with AVX512-BF16), and dense weights keep the
    # file's exact numbers. `--dtype bf16` trades those numbers for dense-weight speed.
    return torch.float32


def keeps_quantized(config: EngineConfig, device: torch.device) -> bool:
    """GGUF weights stay quantized for the CPU kernels, unless told otherwise or they cannot build here."""
    if device.type != "cpu" or config.dequantize:
        return False
    try:
        kernel_library()
    except KernelUnavailable as exc:
        log.warning("int8 kernels unavailable, GGUF weights will be dequantized", extra={"reason": str(exc)})
        return False
    return True


def kv_pool_bytes(config: EngineConfig, model: LoadedModel, device: torch.device, ctx_size: int) -> int:
    """The KV pool's budget: the operator's, else a default for the device capped at max_running
    full contexts (plus the padding block)."""
    block = bytes_per_block(model.config, model.dtype)
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    else:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_CUDA_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_MB * 2**20
        budget = min(budget, (config.max_running * -(-ctx_size // BLOCK_SIZE) + 1) * block)
    if budget < 2 * block:
        raise StartupError(f"--kv-cache-mb {budget / 2**20:g} is smaller than two KV blocks of this model "
                           f"({2 * block / 2**20:.2f} MB)")
    return budget


def load_chat_template(path: str | None, loaded: LoadedModel) -> ChatTemplate:
    """The operator's template file, else the model's own, else its family's (chat_families.py)."""
    source, name = loaded.chat_template, "model"
    if path:
        source, name = read_template_file(Path(path)), "file"
    tokenizer = loaded.tokenizer
    if source is None:
        family = family_for(loaded.config.architecture, tokenizer.backend.get_vocab())
        source, name = family.template, f"family:{family.name}"
    log.info("chat template", extra={"chat_template": name})
    bos = tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.eos_token_id
    try:
        return ChatTemplate(source, bos, tokenizer.token_text(eos) if eos is not None else "", name)
    except ChatTemplateError as exc:
        raise StartupError(f"{path or loaded.path}: {exc}") from exc


def prove_finite_logits(loaded: LoadedModel, device: torch.device) -> None:
    """A forward over PROBE_TEXT on a cache of its own; StartupError when any of its logits is NaN or infinite.

    A model whose numbers overflow would otherwise load, then sample from NaN and answer
    every request for log-probabilities with numbers JSON cannot carry.
    """
    ids = loaded.tokenizer.encode(PROBE_TEXT)[:PROBE_TOKENS]
    if not ids:
        return
    step = contiguous_step(loaded.config, 0, len(ids), device, last_only=False)
    cache = allocate_kv(loaded.config, len(ids), loaded.dtype, device, zeroed=True)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids, dtype=torch.long, device=device), step, cache).float()
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return
    kinds = [name for name, found in (("NaN", torch.isnan(logits).any()), ("infinite", torch.isinf(logits).any()))
             if bool(found)]
    first = int((~finite).any(dim=-1).nonzero()[0])
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
    invariant = loaded.model.native is not None
    if config.speculative is None:
        return "draft" if config.draft_model else "ngram" if invariant else "off"
    if config.speculative != "off" and not invariant:
        log.warning("speculative decoding on a compute path that is not batch-invariant: a verified token "
                    "can differ from step-by-step decoding where two logits tie within float rounding")
    return config.speculative


def draft_speculation(config: EngineConfig, target: ModelRunner, tokenizer: Tokenizer,
                      device: torch.device) -> DraftSpeculation:
    """The draft model, proven to compute and to share the target's vocabulary, with a KV pool of as many
    tokens as the target's."""
    assert config.draft_model is not None
    draft = load_model(config.draft_model, device, resolve_dtype(config.dtype, device),
                       keep_quantized=keeps_quantized(config, device))
    ours, theirs = tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
    if ours != theirs:
        differing = len(set(ours.items()) ^ set(theirs.items()))
        raise StartupError(f"{draft.path}: the draft model's vocabulary ({len(theirs)} tokens) is not the served "
                           f"model's ({len(ours)} tokens; {differing} entries differ): its guesses would be other "
                           "tokens")
    prove_finite_logits(draft, device)
    pool = target.kv.num_blocks * bytes_per_block(draft.config, draft.dtype)
    runner = ModelRunner(draft.model, device, draft.dtype, pool)
    log.info("draft model loaded", extra={"model": draft.name, "path": str(draft.path),
                                          "weights": "gguf blocks" if draft.quantized else "dense"})
    return DraftSpeculation(runner, target.config.vocab_size, config.speculative_tokens, SPECULATIVE_MAX_ROWS)


def build_engine(config: EngineConfig, device: torch.device | None = None, *, loaded: LoadedModel | None = None,
                 telemetry: Telemetry | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Engine:
    """Load the model (unless `loaded` is given) and assemble its runner and engine, not yet started."""
    device = device or torch.device("cpu")
    check_speculative_flags(config)
    telemetry = telemetry or Telemetry()
    path = Path(config.model) if config.model else None
    if loaded is None and path is not None and holds_encoder(path):
        return encoder_engine(config, path, device, telemetry)
    kind = {None: "generate", "rank": "rerank"}.get(config.pooling)
    if kind is None:
        raise StartupError(f"--pooling {config.pooling}: a generating model can rerank (--pooling rank, by its yes/no "
                           "logits); embeddings from a decoder's hidden states are not supported yet")
    if kind == "rerank" and (config.draft_model or config.speculative not in (None, "off")):
        raise StartupError("--pooling rank reads prompts only: speculative decoding does not apply")
    config = replace(config, speculative="off") if kind == "rerank" else config
    config = config.with_limits(kind)
    if loaded is None:
        dtype = resolve_dtype(config.dtype, device)
        loaded = load_model(path or default_model_path(), device, dtype, progress=progress,
                            keep_quantized=keeps_quantized(config, device))
    prove_finite_logits(loaded, device)
    release_freed_memory()  # before the KV pool is allocated, or it would reuse (and keep) the freed pages
    ctx_size = config.ctx_size or loaded.config.context_length
    if not 0 < ctx_size <= loaded.config.context_length:
        source = "--ctx-size" if config.ctx_size else "the model's context_length"
        raise StartupError(f"{source} {ctx_size} is outside 1..{loaded.config.context_length}")
    runner = ModelRunner(loaded.model, device, loaded.dtype, kv_pool_bytes(config, loaded, device, ctx_size))
    speculative = speculation_mode(config, loaded)
    speculation = (draft_speculation(config, runner, loaded.tokenizer, device) if speculative == "draft"
                   else NgramSpeculation(config.speculative_tokens, SPECULATIVE_MAX_ROWS) if speculative == "ngram"
                   else None)
    config = replace(config, ctx_size=ctx_size, speculative=speculative)
    engine = decoder_engine(runner, loaded.tokenizer, config, load_chat_template(config.chat_template_file, loaded),
                            speculation, telemetry, model_name=loaded.name, model_id=loaded.model_id,
                            model_path=loaded.path, rank_tokens=rank_tokens(loaded) if kind == "rerank" else None)
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    engine.telemetry.model.info({"model": loaded.name, "model_id": loaded.model_id, "device": str(device),
                                 "dtype": dtype_name, "kind": kind})
    log.info("model loaded", extra={"model": loaded.name, "path": str(loaded.path), "device": str(device),
                                    "dtype": dtype_name, "threads": torch.get_num_threads(), "kind": kind,
                                    "weights": "gguf blocks" if loaded.quantized else "dense",
                                    "kv_pool_tokens": runner.kv.tokens, "kv_pool_bytes": runner.kv.bytes,
                                    "speculative": speculative, "speculative_tokens": config.speculative_tokens})
    return engine


def holds_encoder(path: Path) -> bool:
    """Whether a model file or directory holds an embedding or rerank encoder (else: a generating decoder)."""
    if path.is_dir():
        return is_encoder(path)
    return path.is_file() and leading_architecture(path) in ENCODER_ARCHITECTURES


def rank_tokens(loaded: LoadedModel) -> tuple[int, int]:
    """A decoder reranker's "no" and "yes" tokens (Qwen3-Reranker's answer words), from its vocabulary."""
    vocab = loaded.tokenizer.backend.get_vocab()
    if "no" not in vocab or "yes" not in vocab:
        raise StartupError(f"{loaded.path}: --pooling rank scores a pair by the tokens 'yes' and 'no', which this "
                           "model's vocabulary does not hold")
    return vocab["no"], vocab["yes"]


def decoder_engine(runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig, chat_template: ChatTemplate | None,
                   speculation: NgramSpeculation | None, telemetry: Telemetry, *, model_name: str, model_id: str,
                   model_path: Path | None = None, rank_tokens: tuple[int, int] | None = None) -> Engine:
    """A generating engine around a runner (or a reranker, given its yes/no tokens): its KV blocks, scheduler,
    core and front door."""
    assert config.ctx_size is not None and config.max_running is not None and config.max_batch_tokens is not None
    blocks = BlockAllocator(runner.kv.num_blocks, runner.kv.block_size, config.prefix_caching)
    scheduler = Scheduler(blocks, config.max_running, config.max_batch_tokens, tokenizer.eos_token_ids, speculation)
    front = FrontDoor(tokenizer, chat_template, config.ctx_size, runner.kv.tokens, config.max_prompt_tokens,
                      Grammars(tokenizer, runner.config.vocab_size), runner.config.vocab_size,
                      kind="rerank" if rank_tokens else "generate")
    return Engine(EngineCore(runner, scheduler, telemetry, rank_tokens), front, tokenizer, config,
                  model_name=model_name, model_id=model_id, telemetry=telemetry, model_path=model_path)


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
    core = EncoderCore(runner, config.max_running, max(config.max_batch_tokens, ctx_size), telemetry)
    front = FrontDoor(loaded.tokenizer, None, ctx_size, ctx_size, config.max_prompt_tokens, None,
                      loaded.config.vocab_size, kind=loaded.kind)
    engine = Engine(core, front, loaded.tokenizer, config, model_name=loaded.name, model_id=loaded.model_id,
                    telemetry=telemetry, model_path=path)
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    telemetry.model.info({"model": loaded.name, "model_id": loaded.model_id, "device": str(device),
                          "dtype": dtype_name, "kind": loaded.kind})
    log.info("model loaded", extra={"model": loaded.name, "path": str(path), "device": str(device), "dtype": dtype_name,
                                    "threads": torch.get_num_threads(), "kind": loaded.kind,
                                    "pooling": loaded.config.pooling, "dimensions": loaded.config.dimensions,
                                    "context": ctx_size})
    return engine
