"""The model runner: batched forward passes over the KV pool, on the worker's device.

The pool (engine.kv.pool) is allocated once, at start-up; the scheduler decides which
blocks each sequence uses. Every tensor the runner creates lives on the worker's
device, and the residency guard checks them; the only values that leave the device
are the sampled token ids (in the sampler) and the log-probabilities asked for.

The C step (models/native.py) runs without a torch device: its pool is host numpy
arrays and its logits come back as numpy, and this module imports no torch for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llorch.engine.kv.block_table import SlotCache
from llorch.engine.kv.pool import KVPool
from llorch.kernels.build import threads
from llorch.models.native import NativeDecoder
from llorch.models.step_layout import ChunkSlots, row_layout
from llorch.weights.model_facts import parameter_count

if TYPE_CHECKING:
    import torch

    from llorch.engine.arrays import Array
    from llorch.models.decoder import Decoder


def out_of_memory(exc: BaseException) -> bool:
    """torch's device allocation failed (told by name, so as not to import torch to ask)."""
    return type(exc).__name__ == "OutOfMemoryError"


@dataclass(frozen=True)
class ChunkInput:
    """A chunk (one sequence's share of a step, scheduler.Chunk) as the runner reads it:
    `token_ids` after `start` cached tokens."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    wants_logits: bool  # the chunk ends the known tokens, so the next token is sampled from it
    # Offsets (within token_ids) of rows whose logits score prompt tokens; they come before the sampling row.
    scored: range = range(0)
    # The last `verified` of token_ids are proposed tokens: the rows of each, after the sampling row, are wanted too.
    verified: int = 0
    # The first `prompt` of token_ids are the job's own prompt tokens, which the C step may compute on a kernel of
    # its own (csrc/amx_bf16.c): none of them is ever computed another way (plan.Chunk.prompt).
    prompt: int = 0


class ModelRunner:
    def __init__(self, model: Decoder | NativeDecoder, device: torch.device | None, dtype: Any,
                 kv_cache_bytes: int) -> None:
        """`device` None runs the C step (`model` a NativeDecoder) on host arrays (kv/pool.py's HOST_KV_DTYPE)."""
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        if isinstance(model, NativeDecoder):
            self.weight_bytes = model.weight_bytes
        else:
            from llorch.device import resident_module_bytes

            self.weight_bytes = resident_module_bytes(device, model)
        kv_dtype = dtype
        if device is not None and getattr(model, "native", None) is not None:
            import torch  # a torch decoder: torch is loaded already

            kv_dtype = torch.float16  # the C step computes it (the loader attached one): its cache's form
        self.kv = KVPool(self.config, device, kv_dtype, kv_cache_bytes)
        self._slots = SlotCache(self.kv.block_size)
        # The C step's cache, each layer's keys and values: one list for the pool's life (NativeDecoder._bound).
        self._cache = [(layer.keys, layer.values) for layer in self.kv.layers]

    @property
    def resident_bytes(self) -> int:
        """Bytes the model and its KV pool hold on the device (the contract's vram_bytes)."""
        return self.weight_bytes + self.kv.bytes

    @property
    def prompt_kernel(self) -> bool:
        """Whether the rows of a prompt (ChunkInput.prompt) are computed by a kernel of their own, with other bits."""
        return isinstance(self.model, NativeDecoder) and self.model.prompt_kernel

    @property
    def parameter_count(self) -> int:
        return parameter_count(self.config)  # from the shapes: GGUF blocks hold several values a byte

    def best_of(self, logits: Array) -> list[int] | None:
        """Each row's argmax of the last forward's logits, when the C step found them (NativeDecoder.best_of):
        the caller vouches that `logits` is that very array, unwritten since."""
        return self.model.best_of(logits) if isinstance(self.model, NativeDecoder) else None

    def forward(self, chunks: list[ChunkInput]) -> Array:
        """Logits [R, vocab] of the wanted rows after one batched forward: per chunk, in order, its scored
        rows, its sampling row and the rows of its proposed tokens.

        Single-token chunks should come first and together: they share one attention call.
        """
        native = isinstance(self.model, NativeDecoder)
        if native and len(chunks) == 1:
            chunk = chunks[0]
            plain = not (chunk.scored or chunk.verified or chunk.prompt)
            if len(chunk.token_ids) == 1 and chunk.wants_logits and plain:
                return self._decode_row(chunk)
        if native and any(chunk.prompt for chunk in chunks):
            return self._forward_with_prompt_rows(chunks)
        specs, ids, logit_rows, row = [], [], [], 0
        for chunk in chunks:
            self._check_blocks(chunk)
            specs.append(ChunkSlots(chunk.start, len(chunk.token_ids), self._slots.slots(chunk.block_table)))
            ids.extend(chunk.token_ids)
            logit_rows.extend(row + offset for offset in chunk.scored)
            row += len(chunk.token_ids)
            if chunk.wants_logits:
                logit_rows.extend(range(row - 1 - chunk.verified, row))
        if native:
            return self.model.forward(ids, row_layout(specs, logit_rows), self._cache, threads())
        import torch

        from llorch.models.step_batch import build_step

        batch = build_step(specs, self.config, self.device, logit_rows, pad_slot=self.kv.pad_slot)
        with torch.inference_mode():
            return self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch, self.kv.layers)

    def _decode_row(self, chunk: ChunkInput) -> Array:
        """forward for one sequence's one decoding row (the steady state of a lone stream) on the C step's
        path for it (NativeDecoder.decode_row)."""
        assert isinstance(self.model, NativeDecoder)
        self._check_blocks(chunk)
        position, size = chunk.start, self.kv.block_size
        write_slot = chunk.block_table[position // size] * size + position % size
        return self.model.decode_row(chunk.token_ids[0], position, write_slot,
                                     self._slots.address(chunk.block_table), self._cache, threads())

    def _check_blocks(self, chunk: ChunkInput) -> None:
        end = chunk.start + len(chunk.token_ids)
        if len(chunk.block_table) * self.kv.block_size < end:
            raise ValueError(f"a chunk ending at position {end} has only {len(chunk.block_table)} blocks")

    def _forward_with_prompt_rows(self, chunks: list[ChunkInput]) -> Array:
        """forward on the C step when some rows are prompt rows: those go last, as the step takes them (its
        rows are independent but for the keys and values they write first), and the wanted rows' logits come
        back in forward's order all the same."""
        assert isinstance(self.model, NativeDecoder)
        others, prompts, ids_others, ids_prompts = [], [], [], []
        for chunk in chunks:
            self._check_blocks(chunk)
            slots, p = self._slots.slots(chunk.block_table), chunk.prompt
            if p < len(chunk.token_ids):
                others.append(ChunkSlots(chunk.start + p, len(chunk.token_ids) - p, slots))
                ids_others.extend(chunk.token_ids[p:])
            if p:
                prompts.append(ChunkSlots(chunk.start, p, slots))
                ids_prompts.extend(chunk.token_ids[:p])
        # Where each chunk's row `offset` went: its prompt rows after every other row, in chunk order.
        logit_rows, other_at, prompt_at = [], 0, len(ids_others)
        for chunk in chunks:
            p, length = chunk.prompt, len(chunk.token_ids)
            wanted = [*chunk.scored, *(range(length - 1 - chunk.verified, length) if chunk.wants_logits else ())]
            logit_rows.extend(prompt_at + offset if offset < p else other_at + offset - p for offset in wanted)
            other_at += length - p
            prompt_at += p
        return self.model.forward(ids_others + ids_prompts, row_layout(others + prompts, logit_rows), self._cache,
                                  threads(), prompt_from=len(ids_others))
