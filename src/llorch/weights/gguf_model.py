"""GGUF metadata -> ModelConfig, and GGUF tensors -> the decoder's state dict.

llama.cpp's conversion conventions are undone here, so the decoder sees the same
numbers a Hugging Face checkpoint would give it (modulo quantization):
- for the `llama` architecture the rows of the q/k projections are permuted (llama.cpp
  rotates interleaved pairs, Hugging Face rotates halves);
- Phi-3's fused qkv and gate_up projections stay fused in the file;
- Llama 3.1's RoPE scaling is stored as a `rope_freqs` tensor of per-frequency divisors;
- Gemma's norm weights are stored as the effective multiplier (1 + w), which is what
  our RMSNorm uses, so they are taken as they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llorch.errors import ModelFileError
from llorch.kernels.blocks import NATIVE_TYPES, repacked
from llorch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llorch.weights import limits
from llorch.weights.arena import WeightArena, arena_bytes, arena_for
from llorch.weights.gguf import GGUFFile
from llorch.weights.limits import bounded_int, finite_float
from llorch.weights.weight_image import Matrices, WeightImage

if TYPE_CHECKING:
    import torch

# Gemma 3 conventions llama.cpp hard-codes instead of storing: every sixth layer is
# global, the others slide; sliding layers use RoPE base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62

# GGUF per-layer tensor names -> our module names.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}



def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    meta, tensors = gguf.metadata, gguf.tensors
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFileError(gguf.path, "has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            gguf.path, f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelFileError(gguf.path, f"metadata {full} is missing")
        return meta[full]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def count(key: str, low: int, high: int, default: Any = None) -> int:
        """A count the config is sized by, bounded before anything uses it."""
        value = need(key) if default is None else get(key, default)
        return bounded_int(value, f"metadata {arch}.{key}", low, high, gguf.path)

    hidden = count("embedding_length", 1, limits.MAX_WIDTH)
    heads = count("attention.head_count", 1, limits.MAX_HEADS)
    head_dim = count("attention.key_length", 1, limits.MAX_HEAD_DIM, default=max(1, hidden // heads))
    layers = count("block_count", 1, limits.MAX_LAYERS)
    blocks = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    if blocks != {str(i) for i in range(layers)}:
        raise ModelFileError(gguf.path, f"block_count is {layers} but the file holds tensors for "
                             f"{len(blocks)} blocks")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelFileError(gguf.path, "tensor token_embd.weight is missing")
    if len(embed.shape) != 2:
        raise ModelFileError(gguf.path, f"tensor token_embd.weight has shape {embed.shape}; it must be 2-D")
    kv_heads = count("attention.head_count_kv", 1, heads, default=heads)
    if heads % kv_heads:
        raise ModelFileError(gguf.path, f"{heads} attention heads cannot share {kv_heads} key/value heads")
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(gguf.path, f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if "rope_factors_long.weight" in tensors:
        raise ModelFileError(gguf.path, "LongRoPE scaling (rope_factors_long) is not supported")
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none", "linear"):
        raise ModelFileError(gguf.path, f"RoPE scaling {scaling_type!r} is not supported")
    factors = None
    if "rope_freqs.weight" in tensors:
        # Counted from the header before a value is read: a file may claim millions of them.
        claimed = math.prod(tensors["rope_freqs.weight"].shape)
        if claimed != head_dim // 2:
            raise ModelFileError(gguf.path, f"rope_freqs has {claimed} factors, expected {head_dim // 2}")
        factors = tuple(float(f) for f in gguf.dequantize("rope_freqs.weight").flatten())

    window = get("attention.sliding_window")
    window = count("attention.sliding_window", 1, limits.MAX_CONTEXT) if window else None
    settings: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=count("vocab_size", 1, limits.MAX_VOCAB, default=embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=count("feed_forward_length", 1, limits.MAX_WIDTH),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=finite_float(need("attention.layer_norm_rms_epsilon"), f"metadata {arch}.attention."
                                  "layer_norm_rms_epsilon", gguf.path),
        context_length=count("context_length", 1, limits.MAX_CONTEXT),
        rope_theta=finite_float(get("rope.freq_base", 10_000.0), f"metadata {arch}.rope.freq_base", gguf.path),
        rope_global_scaling=finite_float(get("rope.scaling.factor", 1.0), f"metadata {arch}.rope.scaling.factor",
                                         gguf.path) if scaling_type == "linear" else 1.0,
        rope_freq_factors=factors,
        # Mistral and Phi-3 slide on every layer when the file gives a window.
        sliding_layers=(window is not None,) * layers,
        sliding_window=window,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
    )
    if arch == "gemma3":
        settings.update(
            sliding_layers=tuple((i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(layers)),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
            attention_scale=_gemma3_attention_scale(hidden, heads, head_dim, layers),
            scale_embeddings=True,
            sandwich_norms=True,
            activation="gelu_tanh",
        )
    return ModelConfig(**settings)


def _gemma3_attention_scale(hidden: int, heads: int, head_dim: int, layers: int) -> float:
    """Gemma 3 scales queries by query_pre_attn_scalar**-0.5, which GGUF does not store.

    It is head_dim in every released size but the 27B (62 layers), where it is
    hidden/heads; llama.cpp decides it the same way.
    """
    return (hidden / heads) ** -0.5 if layers == GEMMA3_27B_LAYERS else head_dim**-0.5


def _optional_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def unpermute_rows(weight: Any, heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation: per head, interleaved (x0, y0, x1, y1, ...)
    rows back to the halves (x0, x1, ..., y0, y1, ...) that rotate_half expects (torch or numpy)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class Split:
    """How one GGUF tensor becomes our entries: whole under one name, its rows un-permuted when llama.cpp
    permuted them by `permuted_heads`; or, with `rows`, cut into consecutive parts of that many rows
    (Phi-3's fused projections). It applies to torch tensors and numpy arrays alike, to values and to a
    matrix's raw block rows (it only selects and reorders rows)."""

    names: tuple[str, ...]
    rows: tuple[int, ...] = ()
    permuted_heads: int | None = None

    def shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The entries' shapes for a tensor of `shape`: ValueError when a fused tensor's rows do not add up."""
        if not self.rows:
            return {self.names[0]: tuple(shape)}
        if shape[0] != sum(self.rows):
            raise ValueError(f"fused tensor has {shape[0]} rows, the config implies {sum(self.rows)}")
        return {name: (rows, *shape[1:]) for name, rows in zip(self.names, self.rows, strict=True)}

    def __call__(self, tensor: Any) -> dict[str, Any]:
        self.shapes(tuple(tensor.shape))
        if not self.rows:
            whole = tensor if self.permuted_heads is None else unpermute_rows(tensor, self.permuted_heads)
            return {self.names[0]: whole}
        ends = list(itertools.accumulate(self.rows))
        return {name: tensor[end - rows : end] for name, rows, end in zip(self.names, self.rows, ends, strict=True)}


def _as(name: str, permuted_heads: int | None = None) -> Split:
    """The tensor under our `name`, its rows un-permuted when llama.cpp permuted them."""
    return Split((name,), permuted_heads=permuted_heads)


def gguf_tensor_plan(config: ModelConfig, present: Collection[str]) -> Iterator[tuple[str, Split]]:
    """(GGUF tensor name, how it becomes our state-dict entries) for every tensor the decoder needs."""
    cfg = config
    yield "token_embd.weight", _as("embed_tokens.weight")
    yield "output_norm.weight", _as("norm.weight")
    if not cfg.tie_word_embeddings:
        yield "output.weight", _as("lm_head.weight")
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def permuted_heads(suffix: str) -> int | None:
        """The head count llama.cpp permuted this tensor's rows by (llama q/k only)."""
        if cfg.architecture != "llama" or suffix not in ("attn_q", "attn_k"):
            return None
        return cfg.num_heads if suffix == "attn_q" else cfg.num_kv_heads

    for i in range(cfg.num_layers):
        blk, ours = f"blk.{i}", f"layers.{i}"
        if f"{blk}.attn_qkv.weight" in present:  # Phi-3
            names = tuple(f"{ours}.self_attn.{p}_proj.weight" for p in "qkv")
            yield f"{blk}.attn_qkv.weight", Split(names, (q_rows, kv_rows, kv_rows))
            fused = {"attn_q", "attn_k", "attn_v"}
        else:
            fused = set()
        if f"{blk}.ffn_gate.weight" not in present and cfg.architecture == "phi3":
            names = (f"{ours}.mlp.gate_proj.weight", f"{ours}.mlp.up_proj.weight")
            yield f"{blk}.ffn_up.weight", Split(names, (cfg.intermediate_size,) * 2)
            fused |= {"ffn_gate", "ffn_up"}
        for suffix, module in _LAYER_TENSORS.items():
            if suffix in fused:
                continue
            if suffix in ("attn_q_norm", "attn_k_norm") and not cfg.qk_norm:
                continue
            if suffix in ("post_attention_norm", "post_ffw_norm") and not cfg.sandwich_norms:
                continue
            yield f"{blk}.{suffix}.weight", _as(f"{ours}.{module}.weight", permuted_heads(suffix))
        if cfg.qkv_bias:
            for suffix in ("attn_q", "attn_k", "attn_v"):
                yield f"{blk}.{suffix}.bias", _as(f"{ours}.{_LAYER_TENSORS[suffix]}.bias", permuted_heads(suffix))
        if cfg.o_bias:
            yield f"{blk}.attn_output.bias", _as(f"{ours}.self_attn.o_proj.bias")
        # llama.cpp calls the norm before the MLP ffn_norm; it is our pre-MLP norm.
        pre_mlp = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        yield f"{blk}.ffn_norm.weight", _as(f"{ours}.{pre_mlp}.weight")


def planned_shapes(gguf: GGUFFile, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's names and shapes as the file's header describes them, read from the header
    alone: compared with the config before any tensor is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for gguf_name, split in gguf_tensor_plan(config, gguf.tensors):
        info = gguf.tensors.get(gguf_name)
        if info is None:
            raise ModelFileError(gguf.path, f"tensor {gguf_name} is missing")
        try:
            shapes.update(split.shapes(tuple(info.shape)))
        except ValueError as exc:  # a fused tensor of the wrong size
            raise ModelFileError(gguf.path, f"tensor {gguf_name}: {exc}") from exc
    return shapes


def read_gguf_weights(
    gguf: GGUFFile,
    config: ModelConfig,
    dequantize: Callable[[str], Any],
    progress: Callable[[int, int], None] | None = None,
    keep_quantized: bool = False,
    image: WeightImage | None = None,
) -> Callable[[], tuple[dict[str, Any], dict[str, int]]]:
    """Starts reading the weights; returns what waits for them and gives our entries with the layout of
    each matrix kept in blocks. The caller parses the tokenizer in between.

    With `keep_quantized`, every matrix stays in the file's own type and layout: its entry holds its
    rows' bytes [rows, row_bytes] (numpy), read on a thread of their own (weights.tensor_read) into one
    huge-page arena (weights.arena), and its layout is its GGUF type or the interleaved layout of that
    type the kernels read fastest on this CPU (kernels.blocks.repacked). With an `image` of those matrices
    (weights.weight_image), they are mapped from it instead, or the image is written once they are ready.
    Every other tensor is what `dequantize(name)` gives (a float32 torch tensor or numpy array).
    """
    plan = list(gguf_tensor_plan(config, gguf.tensors))
    missing = [name for name, _ in plan if name not in gguf.tensors]
    if missing:
        raise ModelFileError(gguf.path, f"tensor {missing[0]} is missing")
    matrices: dict[str, np.ndarray] = {}
    mapped: Matrices | None = None
    arena: WeightArena | None = None
    if keep_quantized:
        names = [name for name, _ in plan if _matrix(gguf, name)]
        if image is not None:
            splits = dict(plan)
            shapes, qtypes = {}, {}
            for name in names:
                info = gguf.tensors[name]
                ours = splits[name].shapes((info.shape[0], info.nbytes // info.shape[0]))
                shapes.update(ours)
                qtypes.update(dict.fromkeys(ours, int(info.qtype)))
            mapped = image.map(shapes, qtypes)
        if mapped is None:
            arena = arena_for(arena_bytes([gguf.tensors[name].nbytes for name in names]))
            for name in names:
                info = gguf.tensors[name]
                matrices[name] = arena.take((info.shape[0], info.nbytes // info.shape[0]))
            arena.trim()
    reading = gguf.start_reading(matrices) if matrices else None

    def finish() -> tuple[dict[str, Any], dict[str, int]]:
        if reading is not None:
            reading.wait()
        entries: dict[str, Any] = {}
        layouts: dict[str, int] = {}
        for done, (gguf_name, split) in enumerate(plan, start=1):
            try:
                if mapped is not None and _matrix(gguf, gguf_name):
                    for ours in split.names:
                        entries[ours], layouts[ours] = mapped.entries[ours], mapped.layouts[ours]
                elif gguf_name in matrices:
                    rows, info = matrices[gguf_name], gguf.tensors[gguf_name]
                    # A selection is a view of the arena's rows; a reordering (a copy of the same shape)
                    # is written back over them.
                    for ours, part in split(rows).items():
                        if not np.may_share_memory(part, rows):  # a reordering made a copy
                            rows[...] = part
                            part = rows
                        layouts[ours] = repacked(part, int(info.qtype), info.shape[1])
                        entries[ours] = part
                else:
                    entries.update(split(dequantize(gguf_name)))
            except (ValueError, RuntimeError) as exc:  # a fused tensor of the wrong size
                raise ModelFileError(gguf.path, f"tensor {gguf_name}: {exc}") from exc
            if progress is not None:
                progress(done, len(plan))
        if image is not None and arena is not None:
            image.write_later(Matrices({name: entries[name] for name in layouts}, layouts), arena)
        return entries, layouts

    return finish


def compute_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight in the compute dtype; norm weights stay float32 (RMSNorm computes in float32)."""
    return tensor.float() if name.endswith("norm.weight") else tensor.to(dtype)


def state_dict_from_gguf(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    keep_quantized: bool = False,
) -> Callable[[], dict[str, torch.Tensor]]:
    """read_gguf_weights for the torch decoder: a call that gives its state dict, in `dtype` (norms stay
    float32); a matrix kept in blocks is "<name>.weight" (uint8 rows, shared with the arena) beside
    "<name>.weight_type", its layout (see models.quantized)."""
    import torch

    from llorch.models.quantized import TYPE_SUFFIX

    finish = read_gguf_weights(gguf, config, gguf.dequantize, progress, keep_quantized)

    def state() -> dict[str, torch.Tensor]:
        entries, layouts = finish()
        converted: dict[str, torch.Tensor] = {}
        for name, value in entries.items():
            if name in layouts:
                converted[name] = torch.from_numpy(value)
                converted[f"{name}{TYPE_SUFFIX}"] = torch.tensor(layouts[name], dtype=torch.int32)
            else:
                converted[name] = compute_tensor(name, value, dtype)
        return converted

    return state


def _matrix(gguf: GGUFFile, name: str) -> bool:
    """A 2-D weight the block kernels read in place (norms and biases are dequantized)."""
    info = gguf.tensors[name]
    is_norm = name.endswith("norm.weight")  # a 2-D norm is a broken file, refused by its shape later
    return name.endswith(".weight") and not is_norm and len(info.shape) == 2 and info.qtype in NATIVE_TYPES
