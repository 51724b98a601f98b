"""Load a model file onto a device for torch: config, weights and tokenizer, all from the file itself.

The C step's loader (native_loader.py) serves GGUF files on the CPU without torch; this one
serves everything else (CUDA, Hugging Face directories, dense or bf16 compute, embeddings)
and the tests that compare the two paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from llorch.errors import ModelFileError
from llorch.models.config import ModelConfig
from llorch.models.decoder import Decoder
from llorch.models.native import NativeDecoder
from llorch.models.quantized import TYPE_SUFFIX, GGUFEmbedding, GGUFLinear, swap_quantized
from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights import hf_model
from llorch.weights.hf_model import SafetensorsCheckpoint, config_from_hf, generation_eos_ids, hf_state_dict
from llorch.weights.model_source import (
    LoadedModel,
    ModelSource,
    check_model_path,
    check_shapes,
    check_tokenizer_fits,
    expected_weights,
    gguf_source,
    read_beside_tokenizer,
    weights_ready,
)
from llorch.weights.template_files import hf_chat_template
from llorch.weights.tokenizer import tokenizer_from_hf_dir

__all__ = ["LoadedModel", "load_model"]


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
    matrices stay in the file's own types, read into one arena, and in float32 every step
    runs as one call of the C decoder step (`model.native`); otherwise all weights are
    dequantized to `dtype` and computed by torch.
    """
    path = Path(path)
    check_model_path(path)
    keep_quantized = keep_quantized and device.type == "cpu" and not hidden_states
    source = _hf_source(path, hidden_states) if path.is_dir() else gguf_source(path)
    if hidden_states:  # an embedding model: its final hidden states are the output, no vocabulary head
        source.config = replace(source.config, tie_word_embeddings=True)
        source.shapes.pop("lm_head.weight", None)
    # Every tensor is what the config needs before one is read: a header may claim anything.
    check_shapes(path, source.shapes, decoder_weight_shapes(source.config))
    tokenizer, weights, started = read_beside_tokenizer(
        source, lambda advance: source.read_weights(dtype, advance, keep_quantized), progress)
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
    weights_ready(source, started)
    return LoadedModel(name=source.name, path=path, config=source.config, model=model, tokenizer=tokenizer,
                       dtype=dtype, chat_template=source.chat_template, quantized=quantized)


def _build_decoder(path: Path, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Decoder:
    """The decoder with `state` as its weights, after checking every name and shape against the config.

    uint8 weights in `state` are GGUF blocks: their layers become the GGUF-typed modules.
    Dense layers are fused afterwards (q/k/v, gate/up); GGUF-typed ones stay apart (their
    types may differ, and the C step reads them side by side anyway).
    """
    layouts = {name.removesuffix(TYPE_SUFFIX): int(tensor) for name, tensor in state.items()
               if name.endswith(TYPE_SUFFIX)}
    expected = expected_weights(path, config, layouts)
    check_shapes(path, {name: tuple(tensor.shape) for name, tensor in state.items() if not name.endswith(TYPE_SUFFIX)},
                 expected)
    with torch.device("meta"):
        model = Decoder(config)
        swap_quantized(model, list(layouts), dtype)
        for name in layouts:  # the skeleton's buffer takes the rows' shape
            module = model.get_submodule(name.removesuffix(".weight"))
            module.register_buffer("weight", torch.empty(expected[name], dtype=torch.uint8))
    model.load_state_dict(state, assign=True, strict=True)
    if not layouts:
        model.fuse_projections()
    return model


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


