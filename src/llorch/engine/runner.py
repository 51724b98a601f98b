"""The model runner: batched forward passes over the KV pool, on the worker's device.

The pool (engine.kv.pool) is allocated once, at start-up; the scheduler decides which
blocks each sequence uses. Every tensor the runner creates lives on the worker's
device, and the residency guard checks them; the only values that leave the device
are the sampled token ids (in the sampler) and the log-probabilities asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llorch.device import resident_module_bytes
from llorch.engine.kv.block_table import slots_of
from llorch.engine.kv.pool import KVPool
from llorch.models.decoder import Decoder
from llorch.models.step_batch import build_step
from llorch.models.step_layout import ChunkSlots
from llorch.weights.model_facts import parameter_count


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


class ModelRunner:
    def __init__(self, model: Decoder, device: torch.device, dtype: torch.dtype, kv_cache_bytes: int) -> None:
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.weight_bytes = resident_module_bytes(device, model)
        self.kv = KVPool(self.config, device, dtype, kv_cache_bytes)

    @property
    def resident_bytes(self) -> int:
        """Bytes the model and its KV pool hold on the device (the contract's vram_bytes)."""
        return self.weight_bytes + self.kv.bytes

    @property
    def parameter_count(self) -> int:
        return parameter_count(self.config)  # from the shapes: GGUF blocks hold several values a byte

    @torch.inference_mode()
    def forward(self, chunks: list[ChunkInput]) -> Tensor:
        """Logits [R, vocab] of the wanted rows after one batched forward: per chunk, in order, its scored
        rows, its sampling row and the rows of its proposed tokens.

        Single-token chunks should come first and together: they share one attention call.
        """
        specs, ids, logit_rows, row = [], [], [], 0
        for chunk in chunks:
            end = chunk.start + len(chunk.token_ids)
            slots = slots_of(chunk.block_table, self.kv.block_size, end)
            specs.append(ChunkSlots(chunk.start, len(chunk.token_ids), slots))
            ids.extend(chunk.token_ids)
            logit_rows.extend(row + offset for offset in chunk.scored)
            row += len(chunk.token_ids)
            if chunk.wants_logits:
                logit_rows.extend(range(row - 1 - chunk.verified, row))
        batch = build_step(specs, self.config, self.device, logit_rows, pad_slot=self.kv.pad_slot)
        return self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch, self.kv.layers)
