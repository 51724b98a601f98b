"""Load a model file onto a device: config, weights and tokenizer, all from the file itself."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llorch.errors import ModelFileError
from llorch.models.config import ModelConfig
from llorch.models.decoder import Decoder
from llorch.weights.gguf import GGUFFile
from llorch.weights.gguf_model import config_from_gguf, state_dict_from_gguf
from llorch.weights.hf_model import (
    PICKLE_SUFFIXES,
    SafetensorsCheckpoint,
    config_from_hf,
    generation_eos_ids,
    hf_state_dict,
)
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

    @property
    def model_id(self) -> str:
        """A stable id for the OpenAI API: the directory's name, or the file's without extension."""
        return self.path.name if self.path.is_dir() else self.path.stem


@dataclass
class ModelSource:
    """What a model file or directory says about itself, before any weight is read."""

    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    # (dtype, progress) -> our state dict; reads and converts the weights.
    read_weights: Callable[[torch.dtype, Callable[[int, int], None]], dict[str, torch.Tensor]]


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Config, tokenizer and weights from a GGUF file or a Hugging Face directory.

    `progress(done, total)` follows the weights.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(path, "no such file or directory")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(path, "pickle checkpoints are refused (loading them can run code); "
                             "use GGUF or safetensors")

    started = time.perf_counter()
    source = _hf_source(path) if path.is_dir() else _gguf_source(path)
    log.info("tokenizer ready", extra={"phase": "tokenizer", "seconds": round(time.perf_counter() - started, 3)})

    started = time.perf_counter()
    with tqdm(desc="loading weights", unit="tensor", disable=not sys.stderr.isatty(), leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if progress is not None:
                progress(done, total)

        state = source.read_weights(dtype, advance)
    model = _build_decoder(path, source.config, state).to(device).eval().requires_grad_(False)
    log.info("weights ready", extra={"phase": "weights", "seconds": round(time.perf_counter() - started, 3)})
    return LoadedModel(name=source.name, path=path, config=source.config, model=model, tokenizer=source.tokenizer,
                       dtype=dtype, chat_template=source.chat_template)


def _build_decoder(path: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> Decoder:
    """The decoder with `state` as its weights, after checking every name and shape against the config."""
    with torch.device("meta"):
        model = Decoder(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            raise ModelFileError(path, f"weight {name} is missing")
        if tuple(state[name].shape) != shape:
            raise ModelFileError(
                path, f"weight {name} has shape {tuple(state[name].shape)}, the config implies {shape}"
            )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ModelFileError(path, f"has weight {unexpected[0]}{more}, which the config does not describe")
    model.load_state_dict(state, assign=True, strict=True)
    return model


def _gguf_source(path: Path) -> ModelSource:
    gguf = GGUFFile(path)
    try:  # metadata of the wrong type or shape is a broken file, not a crash
        config = config_from_gguf(gguf)
        tokenizer = tokenizer_from_gguf(gguf.metadata, path)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(path, f"invalid model metadata ({type(exc).__name__}: {exc})") from exc
    template = gguf.metadata.get("tokenizer.chat_template")
    return ModelSource(
        name=str(gguf.metadata.get("general.name") or path.stem),
        config=config,
        tokenizer=tokenizer,
        chat_template=str(template) if template else None,
        read_weights=lambda dtype, progress: state_dict_from_gguf(gguf, config, dtype, progress),
    )


def _hf_source(path: Path) -> ModelSource:
    checkpoint = SafetensorsCheckpoint(path)
    config = config_from_hf(path, checkpoint.names)
    eos = set(config.eos_token_ids) | generation_eos_ids(path)
    tokenizer = tokenizer_from_hf_dir(path, config.bos_token_id, eos)
    return ModelSource(
        name=path.name,
        config=config,
        tokenizer=tokenizer,
        chat_template=hf_chat_template(path),
        read_weights=lambda dtype, progress: hf_state_dict(checkpoint, config, dtype, progress),
    )


def hf_chat_template(directory: Path) -> str | None:
    """chat_template.jinja, or tokenizer_config.json's chat_template (a string or named templates)."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = read_json_object(directory / "tokenizer_config.json", required=False).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
