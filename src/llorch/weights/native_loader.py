"""Load a GGUF file for the C step, without torch: its matrices in their blocks, its norms and biases
as float32 numpy, described to the C step (models/native.py) as they are read.

What the CPU worker serves a GGUF file with in float32. Importing torch alone would cost the
worker about a second of start-up and 190 MB; nothing on this path needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from llorch.errors import ModelFileError
from llorch.models.native import NativeDecoder, native_decoder_problem
from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights.gguf_model import read_gguf_weights
from llorch.weights.model_source import (
    LoadedModel,
    check_model_path,
    check_shapes,
    expected_weights,
    gguf_source,
    read_beside_tokenizer,
    weights_ready,
)
from llorch.weights.warm_read import take_warm_read
from llorch.weights.weight_image import WeightImage


def load_native(path: str | Path, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Config, tokenizer and the C step's weights from a GGUF file (see loader.load_model for torch)."""
    path = Path(path)
    check_model_path(path)
    if path.is_dir():
        raise ModelFileError(path, "the C step reads GGUF files; a directory is loaded for torch")
    source = gguf_source(path)
    assert source.gguf is not None
    # Every tensor is what the config needs before one is read: a header may claim anything.
    check_shapes(path, source.shapes, decoder_weight_shapes(source.config))
    gguf, config = source.gguf, source.config
    warm = take_warm_read(path)  # a warm start's worker began reading while it imported (weights.warm_read)
    image = WeightImage.beside(source.cache.directory) if source.cache is not None else None
    tokenizer, (weights, layouts), started = read_beside_tokenizer(
        source, lambda advance: warm or read_gguf_weights(gguf, config, gguf.dequantize_array, advance,
                                                          keep_quantized=True, image=image), progress)
    check_shapes(path, {name: tuple(array.shape) for name, array in weights.items()},
                 expected_weights(path, config, layouts))
    weights = {name: array if name in layouts else np.ascontiguousarray(array, dtype=np.float32)
               for name, array in weights.items()}
    problem = native_decoder_problem(config, weights, layouts)
    if problem:
        raise ModelFileError(path, f"the C step cannot run this model: {problem}")
    model = NativeDecoder(config, weights, layouts)
    weights_ready(source, started)
    return LoadedModel(name=source.name, path=path, config=config, model=model, tokenizer=tokenizer,
                       dtype=np.dtype(np.float32), chat_template=source.chat_template, quantized=True)
