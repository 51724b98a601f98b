"""The model runner: the KV pool's memory and batched forward passes on the worker's device.

The pool is allocated once, at start-up, with the budget the operator gave; the
engine's BlockPool decides which blocks each sequence uses. Every tensor the runner
creates lives on the worker's device, and the residency guard checks them; the
only values that leave the device are the sampled token ids (in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llorch.device import assert_module_resident, assert_resident, tensor_bytes
from llorch.engine.kv_blocks import NULL_BLOCK
from llorch.models.config import ModelConfig
from llorch.models.decoder import Decoder
from llorch.models.paged import SegmentSpec, allocate_kv, build_step

BLOCK_SIZE = 16  # tokens per KV block: the unit of allocation and of prefix sharing


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: feed `token_ids` after `start` cached tokens."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    wants_logits: bool  # the chunk ends the known tokens, so the next token is sampled from it


class ModelRunner:
    def __init__(self, model: Decoder, device: torch.device, dtype: torch.dtype, kv_cache_bytes: int,
                 block_size: int = BLOCK_SIZE) -> None:
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        assert_module_resident(device, model)
        self.weight_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
        self.block_bytes = self.bytes_per_block(model.config, dtype, block_size)
        self.num_blocks = kv_cache_bytes // self.block_bytes
        if self.num_blocks < 2:
            raise ValueError("the KV cache budget is smaller than two blocks")
        self.kv = allocate_kv(self.config, self.num_blocks * block_size, dtype, device)
        null = slice(NULL_BLOCK * block_size, (NULL_BLOCK + 1) * block_size)
        for layer in self.kv:  # padding reads the null block: it must hold finite numbers
            layer.keys[null].zero_()
            layer.values[null].zero_()
        assert_resident(device, [item for i, layer in enumerate(self.kv) for item in
                                 ((f"kv.{i}.keys", layer.keys), (f"kv.{i}.values", layer.values))])
        self.kv_bytes = tensor_bytes(t for layer in self.kv for t in (layer.keys, layer.values))
        self._block_offsets = np.arange(block_size, dtype=np.int64)

    @staticmethod
    def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element * block_size

    @property
    def resident_bytes(self) -> int:
        """Bytes the model and its KV pool hold on the device (the contract's vram_bytes)."""
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_pool(self) -> int:
        """Tokens the pool can hold at once (the padding block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> Tensor:
        """Logits [R, vocab] for the segments that want them, in order, after one batched forward.

        Single-token segments should come first and together: they share one attention call.
        """
        specs, ids, logit_rows, row = [], [], [], 0
        for seg in segments:
            end = seg.start + len(seg.token_ids)
            table = np.asarray(seg.block_table, dtype=np.int64)
            slots = (table[:, None] * self.block_size + self._block_offsets).reshape(-1)[:end]
            specs.append(SegmentSpec(seg.start, len(seg.token_ids), slots))
            ids.extend(seg.token_ids)
            row += len(seg.token_ids)
            if seg.wants_logits:
                logit_rows.append(row - 1)
        batch = build_step(specs, self.config, self.device, logit_rows, pad_slot=NULL_BLOCK * self.block_size)
        return self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch, self.kv)
