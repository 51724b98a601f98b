"""What a model file or directory says about itself, and the checks every loader makes of it, without torch.

The torch decoder's loader (loader.py) and the C step's (native_loader.py) both start here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gguf import GGML_QUANT_SIZES

from llorch.errors import ModelFileError
from llorch.kernels.blocks import file_type, row_bytes
from llorch.memory import release_freed_memory
from llorch.models.config import ModelConfig
from llorch.models.native import NativeDecoder
from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights.converted import ConversionCache, ConvertedMeta, file_sha256, known_digest
from llorch.weights.gguf import GGUFFile
from llorch.weights.gguf_model import config_from_gguf, planned_shapes, state_dict_from_gguf
from llorch.weights.limits import (
    MAX_NAME_CHARS,
    MAX_TEMPLATE_CHARS,
    PICKLE_SUFFIXES,
    bounded_text,
    require_regular_file,
)
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf

if TYPE_CHECKING:
    import torch

    from llorch.models.decoder import Decoder

log = logging.getLogger("llorch.weights")
Weights = TypeVar("Weights")


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Decoder | NativeDecoder  # the C step's own description where it computes (see native_loader)
    tokenizer: Tokenizer
    dtype: Any  # torch.dtype; the C step's numpy float32
    chat_template: str | None = None  # jinja2 source, when the model ships one
    quantized: bool = False  # GGUF matrices held in the file's own types for the CPU kernels

    @property
    def native(self) -> NativeDecoder | None:
        """What the C step runs, where it computes this model."""
        return self.model if isinstance(self.model, NativeDecoder) else self.model.native

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
    gguf: GGUFFile | None = None  # a GGUF file's, which the C step's loader reads without torch
    cache: ConversionCache | None = None  # where converted GGUF artifacts are kept
    fresh_meta: ConvertedMeta | None = None  # converted now: cached once the weights load too


def check_model_path(path: Path) -> None:
    """A model path that exists and may be read: a regular file (not /dev/zero, not a FIFO) or a directory,
    never a pickle checkpoint (loading one can run code)."""
    if not path.exists():
        raise ModelFileError(path, "no such file or directory")
    if not path.is_dir():
        require_regular_file(path)  # before hashing: /dev/zero never ends, a FIFO blocks
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(path, "pickle checkpoints are refused (loading them can run code); "
                             "use GGUF or safetensors")


def expected_weights(path: Path, config: ModelConfig, layouts: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every weight the config needs with its shape; a matrix kept in its file's blocks (`layouts` gives
    its type) as rows of the bytes its type takes at the config's width."""
    expected = decoder_weight_shapes(config)
    for name, layout in layouts.items():
        if name not in expected:  # reported by check_shapes as a weight the config does not describe
            continue
        rows, width = expected[name]
        qtype = file_type(layout)
        block = GGML_QUANT_SIZES[qtype][0]
        if width % block:
            raise ModelFileError(path, f"weight {name} is {qtype.name}, whose {block}-value blocks do not divide "
                                 f"the config's width {width}")
        expected[name] = (rows, row_bytes(qtype, width))
    return expected


def progress_bar() -> Any:
    """The loading bar a terminal shows, or None elsewhere (a worker started by a program), where the bar's
    library is not imported at all: its import and its monitor thread came on the start's path."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc="loading weights", unit="tensor", leave=False)


def read_beside_tokenizer(source: ModelSource, start: Callable[[Callable[[int, int], None]], Callable[[], Weights]],
                          progress: Callable[[int, int], None] | None) -> tuple[Tokenizer, Weights, float]:
    """`start(advance)` starts reading the weights and gives what waits for them; the tokenizer parses
    meanwhile. The tokenizer, the weights, and when their wait began (for weights_ready's log)."""
    started = time.perf_counter()
    bar = progress_bar()
    with bar if bar is not None else contextlib.nullcontext():

        def advance(done: int, total: int) -> None:
            if bar is not None:
                bar.total = total
                bar.update(done - bar.n)
            if progress is not None:
                progress(done, total)

        finish = start(advance)
        tokenizer = source.tokenizer()  # parses while the weights read
        release_freed_memory()  # the tokenizer's parse leftovers go before the weights are converted
        log.info("tokenizer ready", extra={"phase": "tokenizer", "seconds": round(time.perf_counter() - started, 3)})
        started = time.perf_counter()
        return tokenizer, finish(), started


def weights_ready(source: ModelSource, started: float) -> None:
    """A file that loaded completely has its conversion cached."""
    if source.cache is not None and source.fresh_meta is not None:
        source.cache.write_meta(source.fresh_meta)
    log.info("weights ready", extra={"phase": "weights", "seconds": round(time.perf_counter() - started, 3)})


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


def check_shapes(path: Path, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
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


def gguf_source(path: Path) -> ModelSource:
    """The file's metadata, from the conversion cache when this file was converted before."""
    digest = known_digest(path)
    # A file not seen before has its header checked before it is read whole for its digest (a sparse
    # file can claim gigabytes at no cost on disk); a warm start maps the file with the cached tensor table.
    gguf = GGUFFile(path) if digest is None else None
    cache = ConversionCache(digest or file_sha256(path))
    cached = cache.read_meta()
    if gguf is None:
        gguf = GGUFFile(path) if cached is None else GGUFFile(path, table=cached.tensors)
    fresh = convert_gguf_meta(path, gguf) if cached is None else None
    meta = cached or fresh
    assert meta is not None

    def tokenizer() -> Tokenizer:
        try:
            return meta.tokenizer()
        except Exception as exc:  # a damaged cached tokenizer.json is rebuilt from the file, never trusted
            log.warning("rebuilding a damaged cached tokenizer", extra={"path": str(cache.directory),
                                                                        "reason": repr(exc)})
            rebuilt = convert_gguf_meta(path, GGUFFile(path))
            cache.write_meta(rebuilt)
            return rebuilt.tokenizer()

    return ModelSource(
        name=meta.name,
        config=meta.config,
        tokenizer=tokenizer,
        chat_template=meta.chat_template,
        shapes=planned_shapes(gguf, meta.config),
        read_weights=lambda dtype, progress, quantized: state_dict_from_gguf(
            gguf, meta.config, dtype, progress, quantized),
        gguf=gguf,
        cache=cache,
        fresh_meta=fresh,
    )


def convert_gguf_meta(path: Path, gguf: GGUFFile) -> ConvertedMeta:
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
