"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> the decoder's state dict.

Our module names are Hugging Face's, so most weights map by dropping the `model.`
prefix. The differences are undone here:
- Phi-3 fuses qkv_proj and gate_up_proj; they are split into our separate projections;
- Gemma stores norm weights as offsets from one (the model computes x * (1 + w));
  our RMSNorm takes the effective multiplier, so 1 is added;
- Llama 3.1's "llama3" RoPE scaling becomes per-frequency divisors, llama.cpp's form.

Only safetensors are read (memory-mapped); pickled checkpoints are refused. Their headers
are read by us first, bounded in size: every tensor's name, type and shape is known and
checked before a tensor is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from llorch.errors import ModelFileError
from llorch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llorch.weights import limits
from llorch.weights.gguf_model import compute_tensor
from llorch.weights.limits import (
    MAX_SAFETENSORS_HEADER_BYTES,
    MAX_TENSORS,
    PICKLE_SUFFIXES,
    bounded_int,
    finite_float,
    require_regular_file,
)
from llorch.weights.tokenizer import read_json_object

# config.json model_type -> our architecture family.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GEMMA3_DEFAULT_SLIDING_PATTERN = 6
# The safetensors types we load (README: F32, F16, BF16), and their sizes.
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_MAX_DIMS = 8
# Integer buffers older transformers saved beside the weights (BERT's position and type ids): skipped.
SAFETENSORS_BUFFERS = {"I64": 8, "I32": 4}
BUFFER_SUFFIXES = (".position_ids", ".token_type_ids")


def config_from_hf(directory: Path, weight_names: set[str]) -> ModelConfig:
    """The config of a directory whose safetensors hold `weight_names`."""
    file = directory / "config.json"
    raw = read_json_object(file)
    model_type = raw.get("model_type")
    if model_type == "gemma3" and "text_config" in raw:
        raise ModelFileError(file, "multimodal Gemma 3 checkpoints are not supported; use a text-only one")
    if model_type not in HF_MODEL_TYPES:
        names = ", ".join(sorted(HF_MODEL_TYPES))
        raise ModelFileError(file, f"unknown architecture model_type={model_type!r} (supported: {names})")
    arch = HF_MODEL_TYPES[model_type]
    assert arch in SUPPORTED_ARCHITECTURES

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelFileError(file, f"has no {key!r}")
        return raw[key]

    def refuse(problem: str) -> ModelFileError:
        return ModelFileError(file, f"{problem} is not supported")

    def count(key: str, low: int, high: int, default: Any = None) -> int:
        """A count the config is sized by, bounded before anything uses it."""
        value = need(key) if default is None else (raw.get(key) or default)
        return bounded_int(value, key, low, high, file)

    def number(key: str, default: float) -> float:
        value = raw.get(key)
        return finite_float(default if value is None else value, key, file)

    hidden, heads = count("hidden_size", 1, limits.MAX_WIDTH), count("num_attention_heads", 1, limits.MAX_HEADS)
    layers = count("num_hidden_layers", 1, limits.MAX_LAYERS)
    head_dim = count("head_dim", 1, limits.MAX_HEAD_DIM, default=max(1, hidden // heads))
    kv_heads = count("num_key_value_heads", 1, heads, default=heads)
    if heads % kv_heads:
        raise ModelFileError(file, f"{heads} attention heads cannot share {kv_heads} key/value heads")
    if raw.get("mlp_bias"):
        raise refuse("mlp_bias")
    if raw.get("attn_logit_softcapping"):
        raise refuse("attention logit soft-capping")
    activation_name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(activation_name) if isinstance(
        activation_name, str) else None
    if activation is None:
        raise refuse(f"activation {activation_name!r}")

    layer_types = _layer_types(raw, arch, layers, file)
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    global_rope = _rope(raw, "full_attention" if arch == "gemma3" else None)
    window = None
    if any(sliding):
        if raw.get("sliding_window") is None:
            raise ModelFileError(file, "has sliding-window layers but no 'sliding_window'")
        window = count("sliding_window", 1, limits.MAX_CONTEXT)
    settings: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=count("vocab_size", 1, limits.MAX_VOCAB),
        hidden_size=hidden,
        intermediate_size=count("intermediate_size", 1, limits.MAX_WIDTH),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number("rms_norm_eps", 1e-6),
        context_length=count("max_position_embeddings", 1, limits.MAX_CONTEXT),
        rope_theta=finite_float(global_rope.get("rope_theta", 10_000.0), "rope_theta", file),
        sliding_layers=sliding,
        sliding_window=window,
        qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias")),
        o_bias=arch == "llama" and bool(raw.get("attention_bias")),
        qk_norm=arch in ("qwen3", "gemma3"),
        activation=activation,
        # When config.json does not say, a checkpoint without lm_head ties it to the embeddings.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", "lm_head.weight" not in weight_names)),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_ids=tuple(sorted(_ids(raw.get("eos_token_id")))),
    )
    if global_rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial rotary embeddings")
    rope_type = global_rope.get("rope_type", "default")
    if rope_type == "linear":
        settings["rope_global_scaling"] = _rope_number(global_rope, "factor", file)
    elif rope_type == "llama3":
        settings["rope_freq_factors"] = llama3_freq_factors(global_rope, head_dim, file)
    elif rope_type != "default":
        raise refuse(f"RoPE scaling {rope_type!r}")
    if arch == "gemma3":
        local = _rope(raw, "sliding_attention")
        softcap = raw.get("final_logit_softcapping")
        settings.update(
            rope_local_theta=finite_float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)),
                                          "rope_local_base_freq", file),
            attention_scale=number("query_pre_attn_scalar", head_dim) ** -0.5,
            scale_embeddings=True,
            sandwich_norms=True,
            final_logit_softcap=finite_float(softcap, "final_logit_softcapping", file) if softcap else None,
        )
    return ModelConfig(**settings)


def _rope_number(rope: dict[str, Any], key: str, file: Path) -> float:
    if rope.get(key) is None:
        raise ModelFileError(file, f"RoPE scaling {rope.get('rope_type')!r} needs {key!r}")
    return finite_float(rope[key], f"RoPE scaling {key}", file)


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def generation_eos_ids(directory: Path) -> set[int]:
    """End-of-generation ids from generation_config.json (Llama 3 lists several there)."""
    return _ids(read_json_object(directory / "generation_config.json", required=False).get("eos_token_id"))


def _layer_types(raw: dict[str, Any], arch: str, layers: int, file: Path) -> list[str]:
    declared = raw.get("layer_types")
    if isinstance(declared, list) and len(declared) == layers:
        return [str(t) for t in declared]
    window = raw.get("sliding_window")
    if arch == "gemma3":
        pattern = bounded_int(raw.get("sliding_window_pattern") or GEMMA3_DEFAULT_SLIDING_PATTERN,
                              "sliding_window_pattern", 1, limits.MAX_LAYERS, file)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if arch in ("qwen2", "qwen3"):
        first = bounded_int(raw.get("max_window_layers", layers), "max_window_layers", 0, limits.MAX_LAYERS, file)
        slides = bool(raw.get("use_sliding_window")) and window is not None
        return ["sliding_attention" if slides and i >= first else "full_attention" for i in range(layers)]
    # Mistral and Phi-3 slide on every layer when config.json gives a window.
    return ["sliding_attention" if window is not None else "full_attention"] * layers


def _rope(raw: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """RoPE settings in one shape, from either config.json spelling.

    Newer files hold `rope_parameters` (per layer type for Gemma 3); older ones
    `rope_theta` plus `rope_scaling` (and Gemma's `rope_local_base_freq`).
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        result = dict(params)
    else:
        result = {"rope_theta": raw.get("rope_theta", 10_000.0)}
        if layer_type == "sliding_attention":
            result["rope_theta"] = raw.get("rope_local_base_freq", 10_000.0)
        else:
            scaling = raw.get("rope_scaling") or {}
            if not isinstance(scaling, dict):
                raise TypeError(f"rope_scaling must be an object, not {type(scaling).__name__}")
            result.update(scaling)
        if "partial_rotary_factor" in raw:
            result["partial_rotary_factor"] = raw["partial_rotary_factor"]
    result["rope_type"] = result.get("rope_type") or result.get("type") or "default"
    return result


def llama3_freq_factors(rope: dict[str, Any], head_dim: int, file: Path) -> tuple[float, ...]:
    """Llama 3.1's frequency-dependent RoPE scaling as a divisor per inverse frequency.

    Long wavelengths are divided by `factor`, short ones kept, and the band between
    interpolated smoothly, as the model was trained.
    """
    theta, factor = _rope_number(rope, "rope_theta", file), _rope_number(rope, "factor", file)
    low, high = _rope_number(rope, "low_freq_factor", file), _rope_number(rope, "high_freq_factor", file)
    original = _rope_number(rope, "original_max_position_embeddings", file)
    if low >= high:
        raise ModelFileError(file, f"RoPE scaling low_freq_factor {low} must be below high_freq_factor {high}")
    divisors = []
    for i in range(0, head_dim, 2):
        inv_freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / inv_freq
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory: one model.safetensors or the shards its index lists."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(index, "has no weight_map")
        files = [directory / _shard_name(index, name) for name in dict.fromkeys(weight_map.values())]
        for shard in files:
            if not shard.exists():
                raise ModelFileError(shard, f"is listed in {INDEX_FILE} but missing")
            require_regular_file(shard)
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ModelFileError(
            directory, f"holds only pickle checkpoints ({', '.join(pickles)}), which are refused because loading "
            "them can run code; convert them to safetensors")
    raise ModelFileError(directory, f"has no {SINGLE_FILE} or {INDEX_FILE}")


def _shard_name(index: Path, name: Any) -> str:
    """A weight_map entry: a file name inside the model directory, never a path out of it.

    Checked by its spelling, not by resolving it: a directory of links into a cache (as hub
    downloads are laid out) stays loadable, while `../x` and `/etc/passwd` are refused.
    """
    if not isinstance(name, str) or not name:
        raise ModelFileError(index, f"weight_map entry {name!r} is not a file name")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or "\\" in name or ":" in name or ".." in parts:
        raise ModelFileError(index, f"weight_map entry {name!r} points outside the model directory")
    return name


def safetensors_header(file: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a safetensors file, from its JSON header.

    The header's size is bounded before it is read and its tensors before it is parsed, and
    every tensor's type is one we load and its bytes fit in the file before anything is sized
    by it (a header alone can describe a million tensors, or a terabyte tensor in a sparse file).
    """
    size = require_regular_file(file)

    def invalid(problem: str) -> ModelFileError:
        return ModelFileError(file, f"is not a valid safetensors file ({problem})")

    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise invalid("shorter than its header's size")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise invalid(f"its header claims {length} bytes, more than the file holds")
        if length > MAX_SAFETENSORS_HEADER_BYTES:
            raise ModelFileError(file, f"has a header of {length} bytes; at most {MAX_SAFETENSORS_HEADER_BYTES} "
                                 "are read")
        header = handle.read(length)
    # Each tensor is a JSON object of its own, and a brace outside a string cannot be escaped.
    if header.count(b"{") > MAX_TENSORS + 2:
        raise ModelFileError(file, f"describes more than {MAX_TENSORS} tensors")
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"header: {exc}") from exc
    except RecursionError as exc:
        raise invalid("its header nests too deeply") from exc
    if not isinstance(entries, dict):
        raise invalid("its header is not a JSON object")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        # A dimension beyond the file's size could only come with another of zero elements.
        if not isinstance(dtype, str) or not isinstance(shape, list) or len(shape) > SAFETENSORS_MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= size for d in shape):
            raise invalid(f"tensor {name} has no valid dtype and shape")
        if dtype in SAFETENSORS_BUFFERS and name.endswith(BUFFER_SUFFIXES) and math.prod(shape) * SAFETENSORS_BUFFERS[
                dtype] <= size:
            continue
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelFileError(file, f"tensor {name} has dtype {dtype}, which is not supported (supported: "
                                 f"{', '.join(sorted(SAFETENSORS_DTYPES))})")
        if math.prod(shape) * SAFETENSORS_DTYPES[dtype] > size:
            raise invalid(f"tensor {name} of shape {shape} needs more bytes than the file holds")
        shapes[name] = tuple(shape)
    return shapes


class SafetensorsCheckpoint:
    """The safetensors files of a directory, opened memory-mapped; tensors are read on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.shapes: dict[str, tuple[int, ...]] = {}  # every tensor's shape, by name, from the headers
        self._handles: list[tuple[Path, Any, list[str]]] = []
        owner: dict[str, Path] = {}
        for file in safetensors_files(directory):
            shapes = safetensors_header(file)
            for name in shapes:
                if name in owner:  # which copy counts would be a guess
                    raise ModelFileError(file, f"tensor {name} is also in {owner[name].name}")
                owner[name] = file
            self.shapes.update(shapes)
            if len(self.shapes) > MAX_TENSORS:
                raise ModelFileError(directory, f"holds more than {MAX_TENSORS} tensors")
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError, json.JSONDecodeError) as exc:
                raise ModelFileError(file, f"is not a valid safetensors file ({exc})") from exc
            self._handles.append((file, handle, list(shapes)))

    @property
    def names(self) -> set[str]:
        return set(self.shapes)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file, handle, names in self._handles:
            for name in names:
                try:
                    yield name, handle.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelFileError(file, f"tensor {name} cannot be read ({exc})") from exc


def _our_parts(directory: Path, name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint tensor under our names: the `model.` prefix dropped, fused projections cut apart."""
    ours = name.removeprefix("model.")
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if ours.endswith("self_attn.qkv_proj.weight"):
        parts = _split(ours, tensor, ["q_proj", "k_proj", "v_proj"], [q_rows, kv_rows, kv_rows])
    elif ours.endswith("mlp.gate_up_proj.weight"):
        parts = _split(ours, tensor, ["gate_proj", "up_proj"], [cfg.intermediate_size] * 2)
    else:
        parts = {ours: tensor}
    if parts is None:
        raise ModelFileError(directory, f"tensor {name} has shape {tuple(tensor.shape)}, which "
                             "does not split into the projections config.json describes")
    return parts


def _drop_or_require_lm_head(directory: Path, names: dict[str, Any], config: ModelConfig) -> None:
    """Tied checkpoints may still store lm_head; untied ones must."""
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    elif "lm_head.weight" not in names:
        raise ModelFileError(directory, "lm_head.weight is missing and config.json says the embeddings are not tied")


def planned_shapes(checkpoint: SafetensorsCheckpoint, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's names and shapes as the headers describe them (the splits run on meta
    tensors): compared with the config before any tensor is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in checkpoint.shapes.items():
        parts = _our_parts(checkpoint.directory, name, torch.empty(shape, dtype=torch.uint8, device="meta"), config)
        shapes.update((ours, tuple(part.shape)) for ours, part in parts.items())
    _drop_or_require_lm_head(checkpoint.directory, shapes, config)
    return shapes


def hf_state_dict(
    checkpoint: SafetensorsCheckpoint,
    config: ModelConfig,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Our state dict from the checkpoint's tensors, in `dtype` (norms stay float32)."""
    state: dict[str, torch.Tensor] = {}
    total = len(checkpoint.names)
    for done, (name, tensor) in enumerate(checkpoint.tensors(), start=1):
        for key, value in _our_parts(checkpoint.directory, name, tensor, config).items():
            if config.architecture == "gemma3" and key.endswith("norm.weight"):
                value = value.float() + 1.0
            state[key] = compute_tensor(key, value, dtype)
        if progress is not None:
            progress(done, total)
    _drop_or_require_lm_head(checkpoint.directory, state, config)
    return state


def _split(name: str, tensor: torch.Tensor, parts: list[str], sizes: list[int]) -> dict[str, torch.Tensor] | None:
    """A fused projection cut into its parts, or None when its rows do not add up."""
    if tensor.shape[0] != sum(sizes):
        return None
    prefix = name.rsplit(".", 2)[0]  # layers.N.self_attn / layers.N.mlp
    return {f"{prefix}.{part}.weight": piece for part, piece in zip(parts, torch.split(tensor, sizes), strict=True)}
