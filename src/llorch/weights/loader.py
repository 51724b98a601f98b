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
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf

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
        """A stable, URL-safe id for the OpenAI API: the file's name without extension."""
        return self.path.stem


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Config, tokenizer and weights from the file; `progress(done, total)` follows the weights."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(path, "no such file or directory")
    if path.is_dir():
        raise ModelFileError(path, "Hugging Face model directories are not supported yet; pass a .gguf file")
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
        raise ModelFileError(path, "pickle checkpoints are refused (they can run code); use GGUF or safetensors")

    started = time.perf_counter()
    gguf = GGUFFile(path)
    try:  # metadata of the wrong type or shape is a broken file, not a crash
        config = config_from_gguf(gguf)
        tokenizer = tokenizer_from_gguf(gguf.metadata, path)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(path, f"invalid model metadata ({type(exc).__name__}: {exc})") from exc
    log.info("tokenizer ready", extra={"phase": "tokenizer", "seconds": round(time.perf_counter() - started, 3)})

    started = time.perf_counter()
    with tqdm(total=len(gguf.tensors), desc="loading weights", unit="tensor", disable=not sys.stderr.isatty(),
              leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if progress is not None:
                progress(done, total)

        state = state_dict_from_gguf(gguf, config, dtype, advance)
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
    model.load_state_dict(state, assign=True, strict=True)
    model = model.to(device).eval().requires_grad_(False)
    log.info("weights ready", extra={"phase": "weights", "seconds": round(time.perf_counter() - started, 3)})
    name = str(gguf.metadata.get("general.name") or path.stem)
    template = gguf.metadata.get("tokenizer.chat_template")
    return LoadedModel(name=name, path=path, config=config, model=model, tokenizer=tokenizer, dtype=dtype,
                       chat_template=str(template) if template else None)
