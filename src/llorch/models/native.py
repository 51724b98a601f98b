"""The decoder run by the C step (kernels/csrc/decoder.c) instead of torch ops, on the CPU.

NativeDecoder describes a model's weights to the C step once, from the config and the
state dict's arrays (GGUF blocks at the file's width with their types, float32 norms and
biases; numpy arrays that it holds, so every pointer stays valid), and runs each forward
step as one C call. It imports no torch: the torch decoder (models/decoder.py) hands its
own tensors over as numpy views and wraps the logits back. It serves models computed in
float32 whose projections are GGUF-typed (or float32) matrices; the torch path serves
everything else (CUDA, bf16/f16 compute, dense weights of other dtypes).
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType

from llorch.kernels.build import library
from llorch.kernels.step import LayerDesc, Matrix, ModelDesc, StepDesc
from llorch.models.config import ModelConfig
from llorch.models.rope import RopeVariant, inverse_frequencies, layer_rope
from llorch.models.step_layout import RowLayout

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
F32 = int(GGMLQuantizationType.F32)
_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _columns(config: ModelConfig, name: str) -> int:
    """A matrix's input width (the embedding's width), which rows of blocks do not tell."""
    if name.endswith("o_proj.weight"):
        return config.num_heads * config.head_dim
    if name.endswith("down_proj.weight"):
        return config.intermediate_size
    return config.hidden_size


def native_decoder_problem(config: ModelConfig, weights: Mapping[str, np.ndarray],
                           types: Mapping[str, int]) -> str | None:
    """Why the C step cannot run this model, or None when it can. `types` names the GGUF type of
    every matrix kept in its file's blocks (uint8 rows); any other matrix must be float32."""
    for name, array in weights.items():
        if array.ndim == 2 and name not in types and array.dtype != np.float32:
            return f"{name.removesuffix('.weight')} holds {array.dtype} weights"
    if config.activation not in ACTIVATIONS:
        return f"activation {config.activation!r}"
    if config.head_dim % 2 or config.hidden_size % 32:
        return "the hidden size is not a multiple of 32"
    return None


class NativeDecoder:
    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], types: Mapping[str, int]) -> None:
        problem = native_decoder_problem(config, weights, types)
        if problem:
            raise ValueError(f"the C step cannot run this model: {problem}")
        cfg = self.config = config
        self.weights = dict(weights)  # keeps every array the descriptors point into alive
        self.types = dict(types)
        self.weight_bytes = sum(array.nbytes for array in self.weights.values())
        self.lib = library()
        self.vocab = cfg.vocab_size
        self._logits_buffer: np.ndarray | None = None  # reused across steps (_logits)
        self._bound_cache: list[tuple[np.ndarray, np.ndarray]] = []  # the KV arrays the descriptors point into
        self._bound_list: object = None  # the very list they came in, while it is the one bound (_bound)
        self._best = (ctypes.c_int64 * 1)()  # the last step's argmax of each logits row (best_of)
        self._best_last = self._best  # the array the last step wrote them into: _best, or _row_best
        self._best_of: weakref.ref[np.ndarray] | None = None  # ... and the logits it returned them with
        # One decoding row's step (decode_row), described once: token, position, write slot, its slot start and
        # its logits row (both 0), and a logits buffer of its own.
        self._row = (ctypes.c_int64 * 5)()
        self._row_best = (ctypes.c_int64 * 1)()
        row = ctypes.addressof(self._row)
        self._row_step = StepDesc(rows=1, tokens=row, positions=row + 8, write_slots=row + 16, slot_start=row + 24,
                                  logit_rows_count=1, logit_rows=row + 32, best=ctypes.addressof(self._row_best),
                                  prompt_from=1)
        self._row_step_address = ctypes.addressof(self._row_step)
        self._row_logits: np.ndarray | None = None
        variants: list[RopeVariant] = []
        layers = []
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}."
            variant = layer_rope(cfg, cfg.sliding_layers[i])
            if variant not in variants:
                variants.append(variant)
            sandwich = cfg.sandwich_norms
            matrices = {field: self._matrix(prefix + module + ".weight") for field, module in _PROJECTIONS.items()}
            layers.append(LayerDesc(
                **matrices,
                q_bias=self._pointer(prefix + "self_attn.q_proj.bias"),
                k_bias=self._pointer(prefix + "self_attn.k_proj.bias"),
                v_bias=self._pointer(prefix + "self_attn.v_proj.bias"),
                o_bias=self._pointer(prefix + "self_attn.o_proj.bias"),
                input_norm=self._pointer(prefix + "input_layernorm.weight"),
                post_attn_norm=self._pointer(prefix + "post_attention_layernorm.weight"),
                pre_ffn_norm=self._pointer(prefix + "pre_feedforward_layernorm.weight") if sandwich else None,
                post_ffn_norm=self._pointer(prefix + "post_feedforward_layernorm.weight") if sandwich else None,
                q_norm=self._pointer(prefix + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=self._pointer(prefix + "self_attn.k_norm.weight") if cfg.qk_norm else None,
                window=cfg.sliding_window if cfg.sliding_layers[i] and cfg.sliding_window else 0,
                rope=variants.index(variant),
            ))
        if len(variants) > 2:
            raise ValueError("the C step takes at most two RoPE variants")
        self.layers = (LayerDesc * len(layers))(*layers)
        self.embed = self._matrix("embed_tokens.weight")
        self.head = self._matrix("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        self.model = ModelDesc(
            hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_layers,
            eps=cfg.rms_norm_eps, attn_scale=cfg.scale,
            # Rounded to float32 first, as the torch path does.
            embed_scale=float(np.float32(cfg.hidden_size**0.5)) if cfg.scale_embeddings else 0.0,
            logit_softcap=cfg.final_logit_softcap or 0.0, sandwich=int(cfg.sandwich_norms),
            activation=ACTIVATIONS[cfg.activation], final_norm=self._pointer("norm.weight"),
        )
        self.model.embed = ctypes.pointer(self.embed)
        self.model.head = ctypes.pointer(self.head)
        self.model.layer = self.layers
        # Each RoPE variant's inverse frequencies; the C step turns positions into angles itself.
        self.inv_freq = [inverse_frequencies(cfg.head_dim, variant) for variant in variants]
        for i in range(2):
            variant = min(i, len(variants) - 1)
            self.model.inv_freq[i] = self.inv_freq[variant].ctypes.data
            self.model.rope_scaling[i] = variants[variant].scaling
        self._model_address = ctypes.addressof(self.model)

    def _matrix(self, name: str) -> Matrix:
        weight = self.weights[name]
        if not weight.flags.c_contiguous:
            raise ValueError("a weight the C step reads must be contiguous")
        if name in self.types:  # uint8 rows of the file's blocks
            return Matrix(self.types[name], 0, weight.ctypes.data, weight.shape[0], _columns(self.config, name))
        return Matrix(F32, 0, weight.ctypes.data, weight.shape[0], weight.shape[1])  # a float32 row is an F32 row

    def _pointer(self, name: str) -> int | None:
        array = self.weights.get(name)
        if array is None:
            return None
        if array.dtype != np.float32 or not array.flags.c_contiguous:
            raise ValueError("norms and biases the C step reads must be contiguous float32")
        return array.ctypes.data

    @property
    def prompt_kernel(self) -> bool:
        """Whether a prompt's rows have a kernel of their own here (runner.ChunkInput.prompt; csrc/amx_bf16.c)."""
        return bool(self.lib.llorch_bf16_takes(ctypes.byref(self.layers[0].q), 1))

    def _logits(self, rows: int) -> np.ndarray:
        """A [rows, vocab] float32 array for a step's logits: the last step's, when no one holds it any more.

        A fresh array of a row or more of a 262k vocabulary is a mapping of its own (memory.py), so
        every step paid a page fault per 4 KiB of it (256 a row, 8192 at 32 rows) and an unmap.
        A caller that keeps a step's logits (or a view of them) holds the buffer, and the next step
        gets a new one."""
        buffer = self._logits_buffer
        # Held only by this attribute, this local and getrefcount's argument: no caller has it.
        if buffer is None or buffer.shape[0] < rows or sys.getrefcount(buffer) > 3:
            buffer = self._logits_buffer = np.empty((rows, self.vocab), dtype=np.float32)
        return buffer[:rows]

    def _bound(self, cache: Sequence[tuple[np.ndarray, np.ndarray]]) -> bool:
        """The layer descriptors point into these very arrays already (the pool's, step after step):
        checking and binding each layer's pair anew took about 5 µs a layer, every token. The very list
        they were bound from is taken as it is: a runner hands the same unchanging list every step."""
        if cache is self._bound_list:
            return True
        bound = self._bound_cache
        return len(bound) == len(cache) and all(
            keys is bound_keys and values is bound_values
            for (keys, values), (bound_keys, bound_values) in zip(cache, bound, strict=True))

    def _bind(self, cache: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        if not self._bound(cache):
            for desc, (keys, values) in zip(self.layers, cache, strict=True):
                if keys.dtype != np.float16 or not keys.flags.c_contiguous or not values.flags.c_contiguous:
                    raise ValueError("the C step needs a contiguous float16 KV cache")
                desc.keys, desc.values = keys.ctypes.data, values.ctypes.data
                # the C step keeps its own layout in these buffers, [kv_heads, slots, head_dim] whatever their shape
                desc.kv_slots = keys.size // (self.model.kv_heads * self.model.head_dim)
            self._bound_cache = [(keys, values) for keys, values in cache]  # held: their memory stays theirs
        self._bound_list = cache

    def forward(self, token_ids: Sequence[int] | np.ndarray, layout: RowLayout,
                cache: Sequence[tuple[np.ndarray, np.ndarray]], threads: int, prompt_from: int | None = None,
                ) -> np.ndarray:
        """Logits [R, vocab] of the step's wanted rows (float32); `cache` holds each layer's keys and values.
        Rows from `prompt_from` on are tokens of their jobs' prompts (runner.ChunkInput.prompt; None: no row)."""
        if isinstance(token_ids, np.ndarray):
            valid = not token_ids.size or 0 <= int(token_ids.min()) <= int(token_ids.max()) < self.vocab
        else:  # a step's list of ids: checked without numpy's per-call cost
            valid = not token_ids or 0 <= min(token_ids) <= max(token_ids) < self.vocab
        if not valid:
            raise IndexError(f"token id out of range for a vocabulary of {self.vocab}")
        tokens = np.array(token_ids, dtype=np.int64)
        self._bind(cache)
        rows = len(layout.logit_rows)
        logits = self._logits(rows)
        if len(self._best) < rows:
            self._best = (ctypes.c_int64 * rows)()
        # The layout's arrays are contiguous int64 as row_layout builds them: no conversion, every token.
        step = StepDesc(rows=len(layout.positions), tokens=tokens.ctypes.data, positions=layout.positions.ctypes.data,
                        write_slots=layout.write_slots.ctypes.data, slot_start=layout.slot_start.ctypes.data,
                        slots=layout.slots.ctypes.data, logit_rows_count=rows,
                        logit_rows=layout.logit_rows.ctypes.data, logits=logits.ctypes.data,
                        best=ctypes.addressof(self._best),
                        prompt_from=len(layout.positions) if prompt_from is None else prompt_from)
        self._best_of = None
        if self.lib.llorch_decoder_forward(self._model_address, ctypes.addressof(step), threads) != 0:
            raise MemoryError(f"the C step could not allocate its buffers for {step.rows} rows")
        self._best_last = self._best
        self._best_of = weakref.ref(logits)  # weak: a held array would keep the buffer from reuse (_logits)
        return logits

    def decode_row(self, token: int, position: int, write_slot: int, slots: int,
                   cache: Sequence[tuple[np.ndarray, np.ndarray]], threads: int) -> np.ndarray:
        """forward's logits [1, vocab] for one sequence's one decoding row: `token` at `position`, its key and
        value written at `write_slot`, its slots (every position's, up to `position`) at address `slots`.

        Why a path of its own: the step's weights push everything else out of the caches every token, so
        forward's per-step numpy and ctypes objects, some 16 µs of work in cache, took about 100 µs from
        memory (the default model, Zen 5). This row's step is described once and only its numbers change."""
        if not 0 <= token < self.vocab:
            raise IndexError(f"token id out of range for a vocabulary of {self.vocab}")
        self._bind(cache)
        logits = self._row_logits
        # Held only by this attribute, this local and getrefcount's argument: no caller kept the last one.
        if logits is None or sys.getrefcount(logits) > 3:
            logits = self._row_logits = np.empty((1, self.vocab), dtype=np.float32)
            self._row_step.logits = logits.ctypes.data
        row = self._row
        row[0], row[1], row[2] = token, position, write_slot
        step = self._row_step
        step.slots = slots
        self._best_of = None
        if self.lib.llorch_decoder_forward(self._model_address, self._row_step_address, threads) != 0:
            raise MemoryError("the C step could not allocate its buffers for 1 row")
        self._best_last = self._row_best
        self._best_of = weakref.ref(logits)
        return logits

    def best_of(self, logits: np.ndarray) -> list[int] | None:
        """Each row's argmax (the first of equal values), when `logits` is the very array the last step
        returned (the step found them while its threads were up); None for any other array, or when a
        row holds a NaN (the array's own argmax decides that). The caller vouches that nothing has
        written into the array since."""
        if self._best_of is None or self._best_of() is not logits:
            return None
        best = self._best_last[: len(logits)]
        return best if min(best, default=0) >= 0 else None
