"""Load a model file onto a device: config, weights and tokenizer, all from the file itself."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from tqdm import tqdm

from llorch.errors import ModelFileError
from llorch.kernels.blocks import file_type, row_bytes
from llorch.memory import release_freed_memory
from llorch.models.config import ModelConfig
from llorch.models.decoder import Decoder
from llorch.models.native import NativeDecoder
from llorch.models.quantized import TYPE_SUFFIX, GGUFEmbedding, GGUFLinear, swap_quantized
from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights import gguf_model, hf_model
from llorch.weights.converted import ConversionCache, ConvertedMeta, file_sha256, known_digest
from llorch.weights.gguf import GGUFFile
from llorch.weights.gguf_model import config_from_gguf, state_dict_from_gguf
from llorch.weights.hf_model import (
    PICKLE_SUFFIXES,
    SafetensorsCheckpoint,
    config_from_hf,
    generation_eos_ids,
    hf_state_dict,
)
from llorch.weights.limits import MAX_NAME_CHARS, MAX_TEMPLATE_CHARS, bounded_text, require_regular_file
from llorch.weights.tokenizer import Tokenizer, read_json_object, tokenizer_from_gguf, tokenizer_from_hf_dir

log = logging.getLogger("llorch.weights")


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    dtype: torch.dtype
    chat_template: str | None = None  # jinja2 source, when the model ships one
    quantized: bool = False  # GGUF matrices held in the file's own types for the CPU kernels

    @property
    def model_id(self) -> str:
        """A stable id for the OpenAI API: the directory's name, or the file's without extension."""
        return self.path.name if self.path.is_dir() else self.path.stem


@dataclass
class ModelSource:
    """What a model file or directory says about itself, before any weight is read."""

    name: str
    config: ModelConfig
    tokenizer: Callable[[], Tokenizer]  # built, or parsed when called (see ConvertedMeta.tokenizer)
    chat_template: str | None
    shapes: dict[str, tuple[int, ...]]  # our state dict's names and element shapes, as the file's header says
    # (dtype, progress, keep_quantized) -> a call that gives our state dict: the weights start
    # reading at the first call and are converted, once read, at the second.
    read_weights: Callable[[torch.dtype, Callable[[int, int], None], bool], Callable[[], dict[str, torch.Tensor]]]
    cache: ConversionCache | None = None  # where converted GGUF artifacts are kept
    fresh_meta: ConvertedMeta | None = None  # converted now: cached once the weights load too


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    keep_quantized: bool = False,
    hidden_states: bool = False,
) -> LoadedModel:
    """Config, tokenizer and weights from a GGUF file or a Hugging Face directory.

    `progress(done, total)` follows the weights. With `keep_quantized` (CPU only), GGUF
    matrices stay in the file's own types, viewed in place in the mapped file, and every
    step runs as one call of the C decoder step; otherwise all weights are dequantized to
    `dtype` and computed by torch.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(path, "no such file or directory")
    if not path.is_dir():
        require_regular_file(path)  # before hashing: /dev/zero never ends, a FIFO blocks
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(path, "pickle checkpoints are refused (loading them can run code); "
                             "use GGUF or safetensors")

    started = time.perf_counter()
    keep_quantized = keep_quantized and device.type == "cpu" and not hidden_states
    source = _hf_source(path, hidden_states) if path.is_dir() else _gguf_source(path)
    if hidden_states:  # an embedding model: its final hidden states are the output, no vocabulary head
        source.config = replace(source.config, tie_word_embeddings=True)
        source.shapes.pop("lm_head.weight", None)
    # Every tensor is what the config needs before one is read: a header may claim anything.
    _check_shapes(path, source.shapes, decoder_weight_shapes(source.config))

    with tqdm(desc="loading weights", unit="tensor", disable=not sys.stderr.isatty(), leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if progress is not None:
                progress(done, total)

        converted = source.read_weights(dtype, advance, keep_quantized)
        tokenizer = source.tokenizer()  # parses while the weights read
        release_freed_memory()  # the tokenizer's parse leftovers go before the weights are converted
        log.info("tokenizer ready", extra={"phase": "tokenizer", "seconds": round(time.perf_counter() - started, 3)})
        started = time.perf_counter()
        weights = converted()
        if hidden_states:
            weights.pop("lm_head.weight", None)
        model = _build_decoder(path, source.config, weights, dtype)
        model.hidden_states = hidden_states
    model = model.to(device).eval().requires_grad_(False)
    quantized = any(isinstance(m, GGUFLinear | GGUFEmbedding) for m in model.modules())
    if quantized and device.type == "cpu" and dtype == torch.float32:
        # The C step reads the module's own tensors, as numpy views.
        arrays = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
        types = {name.removesuffix(TYPE_SUFFIX): int(arrays.pop(name)) for name in list(arrays)
                 if name.endswith(TYPE_SUFFIX)}
        model.native = NativeDecoder(source.config, arrays, types)
    if source.cache is not None and source.fresh_meta is not None:  # only a file that loaded completely
        source.cache.write_meta(source.fresh_meta)
    log.info("weights ready", extra={"phase": "weights", "seconds": round(time.perf_counter() - started, 3)})
    return LoadedModel(name=source.name, path=path, config=source.config, model=model, tokenizer=tokenizer,
                       dtype=dtype, chat_template=source.chat_template, quantized=quantized)


def check_tokenizer_fits(path: Path, tokenizer: Tokenizer, largest: int, config: ModelConfig) -> None:
    """Every id the tokenizer can produce (up to `largest`) has an embedding row; otherwise every job
    would fail later. Checked where a tokenizer is built, not on a warm start from the conversion cache."""
    if largest >= config.vocab_size:
        raise ModelFileError(path, f"the tokenizer produces token id {largest}, but the embedding holds only "
                             f"{config.vocab_size} tokens")
    special = [i for i in (tokenizer.bos_token_id, *tokenizer.eos_token_ids) if i is not None]
    if any(not 0 <= i < config.vocab_size for i in special):
        raise ModelFileError(path, f"the BOS/EOS token ids {sorted(special)} are not all below the vocabulary "
                             f"size {config.vocab_size}")


def _build_decoder(path: Path, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Decoder:
    """The decoder with `state` as its weights, after checking every name and shape against the config.

    uint8 weights in `state` are GGUF blocks: their layers become the GGUF-typed modules.
    Dense layers are fused afterwards (q/k/v, gate/up); GGUF-typed ones stay apart (their
    types may differ, and the C step reads them side by side anyway).
    """
    blocks = [name for name, tensor in state.items() if tensor.dtype == torch.uint8]
    with torch.device("meta"):
        model = Decoder(config)
        swap_quantized(model, blocks, dtype)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    for name in blocks:
        expected[name] = (expected[name][0], _row_bytes(path, name, model, state))
        module = model.get_submodule(name.removesuffix(".weight"))  # the skeleton's buffer takes that shape
        module.register_buffer("weight", torch.empty(expected[name], dtype=torch.uint8, device="meta"))
    _check_shapes(path, {name: tuple(tensor.shape) for name, tensor in state.items()}, expected)
    model.load_state_dict(state, assign=True, strict=True)
    if not blocks:
        model.fuse_projections()
    return model


def _check_shapes(path: Path, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """`shapes` are exactly the weights `expected`: none missing, none extra, each of its shape."""
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelFileError(path, f"weight {name} is missing")
        if tuple(shapes[name]) != shape:
            raise ModelFileError(path, f"weight {name} has shape {tuple(shapes[name])}, the config implies {shape}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ModelFileError(path, f"has weight {unexpected[0]}{more}, which the config does not describe")


def _row_bytes(path: Path, name: str, model: Decoder, state: dict[str, torch.Tensor]) -> int:
    """The bytes one row of the GGUF-typed weight `name` must have, by its type and the config's width."""
    module = model.get_submodule(name.removesuffix(".weight"))
    width = module.in_features if isinstance(module, GGUFLinear) else module.embedding_dim
    qtype = file_type(int(state[f"{name}{TYPE_SUFFIX}"]))
    block = GGML_QUANT_SIZES[qtype][0]
    if width % block:
        raise ModelFileError(path, f"weight {name} is {qtype.name}, whose {block}-value blocks do not divide "
                             f"the config's width {width}")
    return row_bytes(qtype, width)


def _gguf_source(path: Path) -> ModelSource:
    """The file's metadata, from the conversion cache when this file was converted before."""
    digest = known_digest(path)
    # A file not seen before has its header checked before it is read whole for its digest (a sparse
    # file can claim gigabytes at no cost on disk); a warm start maps the file with the cached tensor table.
    gguf = GGUFFile(path) if digest is None else None
    cache = ConversionCache(digest or file_sha256(path))
    cached = cache.read_meta()
    if gguf is None:
        gguf = GGUFFile(path) if cached is None else GGUFFile(path, table=cached.tensors)
    fresh = _convert_gguf_meta(path, gguf) if cached is None else None
    meta = cached or fresh
    assert meta is not None

    def tokenizer() -> Tokenizer:
        try:
            return meta.tokenizer()
        except Exception as exc:  # a damaged cached tokenizer.json is rebuilt from the file, never trusted
            log.warning("rebuilding a damaged cached tokenizer", extra={"path": str(cache.directory),
                                                                        "reason": repr(exc)})
            rebuilt = _convert_gguf_meta(path, GGUFFile(path))
            cache.write_meta(rebuilt)
            return rebuilt.tokenizer()

    return ModelSource(
        name=meta.name,
        config=meta.config,
        tokenizer=tokenizer,
        chat_template=meta.chat_template,
        shapes=gguf_model.planned_shapes(gguf, meta.config),
        read_weights=lambda dtype, progress, quantized: state_dict_from_gguf(
            gguf, meta.config, dtype, progress, quantized),
        cache=cache,
        fresh_meta=fresh,
    )


def _convert_gguf_meta(path: Path, gguf: GGUFFile) -> ConvertedMeta:
    try:  # metadata of the wrong type or shape is a broken file, not a crash
        config = config_from_gguf(gguf)
        tokenizer = tokenizer_from_gguf(gguf.metadata, path)
        # The ids are the vocabulary's positions: counting it is enough.
        check_tokenizer_fits(path, tokenizer, len(gguf.metadata["tokenizer.ggml.tokens"]) - 1, config)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(path, f"invalid model metadata ({type(exc).__name__}: {exc})") from exc
    template = gguf.metadata.get("tokenizer.chat_template")
    if template:
        bounded_text(template, "metadata tokenizer.chat_template", MAX_TEMPLATE_CHARS, path)
    name = gguf.metadata.get("general.name") or path.stem
    return ConvertedMeta(name=bounded_text(name, "metadata general.name", MAX_NAME_CHARS, path), config=config,
                         chat_template=template or None, tokenizer=lambda: tokenizer, tensors=gguf.tensor_table())


def _hf_source(path: Path, headless: bool = False) -> ModelSource:
    """`headless`: the checkpoint may lack the vocabulary head (an embedding model's base model)."""
    checkpoint = SafetensorsCheckpoint(path)
    try:  # values of the wrong type or shape are a broken file, not a crash
        config = config_from_hf(path, checkpoint.names)
        if headless:
            config = replace(config, tie_word_embeddings=True)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(path / "config.json", f"invalid config ({type(exc).__name__}: {exc})") from exc
    eos = set(config.eos_token_ids) | generation_eos_ids(path)
    tokenizer = tokenizer_from_hf_dir(path, config.bos_token_id, eos)
    # A tokenizer.json may number its tokens sparsely: only the largest id tells.
    check_tokenizer_fits(path, tokenizer, max(tokenizer.backend.get_vocab().values(), default=-1), config)
    return ModelSource(
        name=path.name,
        config=config,
        tokenizer=lambda: tokenizer,
        chat_template=hf_chat_template(path),
        shapes=hf_model.planned_shapes(checkpoint, config),
        # Safetensors checkpoints hold dense weights; they are used as they are.
        read_weights=lambda dtype, progress, _quantized: lambda: hf_state_dict(checkpoint, config, dtype, progress),
    )


def hf_chat_template(directory: Path) -> str | None:
    """chat_template.jinja, or tokenizer_config.json's chat_template (a string or named templates)."""
    file = directory / "chat_template.jinja"
    if file.exists():
        return read_template_file(file)
    settings = read_json_object(directory / "tokenizer_config.json", required=False)
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return bounded_text(template, "tokenizer_config.json chat_template", MAX_TEMPLATE_CHARS, directory)


def read_template_file(file: Path) -> str:
    """A jinja2 chat template file: a regular file of at most MAX_TEMPLATE_CHARS (bytes, to read no more)."""
    size = require_regular_file(file)
    if size > MAX_TEMPLATE_CHARS:
        raise ModelFileError(file, f"is {size} bytes; a chat template may have at most {MAX_TEMPLATE_CHARS}")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(file, f"cannot be read as a UTF-8 chat template ({exc})") from exc
