"""The layout of one batched forward step over a KV cache of slots.

Every layer stores keys and values as `[slots, kv_heads, head_dim]` (LayerKV; the
engine allocates them, see llorch.engine.kv; the C step keeps its own layout in its
buffers, [kv_heads, slots, head_dim]). A sequence's tokens live in slots
scattered over the pool; a step says, for every new token, which slot it writes,
and for every sequence, which slots its queries read.

One step carries the new tokens of many sequences flattened into N rows: every
linear layer runs once over all N rows, and attention runs per group. A group is
either a run of single-token sequences (the decoding ones, batched into one
attention call, shorter histories padded and masked) or one sequence's chunk of
prompt. Padding reads slot `pad_slot`, which must hold finite numbers (the engine
reserves a zeroed block for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from llorch.models.config import ModelConfig
from llorch.models.step_layout import ChunkSlots, RowLayout, row_layout


@dataclass(frozen=True)
class KeyView:
    """What a group's queries read: slot indices [batch, keys] and a mask [batch, 1, q_len, keys] (None: all).

    `span` (first slot, end slot) is set when one sequence's keys lie in consecutive
    slots, as a lone stream's usually do: they are then read as a view, not gathered.
    """

    slots: Tensor
    mask: Tensor | None
    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class AttentionGroup:
    """Rows [start, start + batch * q_len) of the step: `batch` sequences of `q_len` queries."""

    start: int
    batch: int
    q_len: int
    full: KeyView
    window: KeyView | None  # for sliding-window layers; None when the model has none

    @property
    def rows(self) -> int:
        return self.batch * self.q_len


@dataclass
class StepBatch:
    layout: RowLayout
    specs: list[ChunkSlots]
    config: ModelConfig
    device: torch.device
    pad_slot: int
    all_logits: bool  # every row's logits are wanted (layout.logit_rows lists them all)
    _rope: dict[tuple[float, float, int], tuple[Tensor, Tensor]] = field(default_factory=dict)
    _positions: Tensor | None = None
    _write_slots: Tensor | None = None
    _groups: list[AttentionGroup] | None = None

    @property
    def rows(self) -> int:
        return len(self.layout.positions)

    @property
    def positions(self) -> Tensor:
        if self._positions is None:
            self._positions = torch.from_numpy(self.layout.positions).to(self.device)
        return self._positions

    @property
    def slots(self) -> Tensor:
        """Where every new token's key and value are written, on the device."""
        if self._write_slots is None:
            self._write_slots = torch.from_numpy(self.layout.write_slots).to(self.device)
        return self._write_slots

    @property
    def logit_rows(self) -> Tensor | None:
        """Rows whose logits are wanted, on the device; None: every row."""
        return None if self.all_logits else torch.from_numpy(self.layout.logit_rows).to(self.device)

    @property
    def groups(self) -> list[AttentionGroup]:
        """The torch attention layout (groups of sequences with their key views), built on first use."""
        if self._groups is None:
            self._groups = _attention_groups(self.specs, self.config, self.device, self.pad_slot)
        return self._groups

    def rope(self, key: tuple[float, float, int], compute: Callable[[], tuple[Tensor, Tensor]]
             ) -> tuple[Tensor, Tensor]:
        """cos/sin for this step's positions, computed once per rope variant instead of once per layer."""
        if key not in self._rope:
            self._rope[key] = compute()
        return self._rope[key]


def build_step(specs: list[ChunkSlots], config: ModelConfig, device: torch.device,
               logit_rows: list[int] | None = None, pad_slot: int = 0) -> StepBatch:
    """The layout of one step (host arrays; device tensors are made when a path asks for them)."""
    return StepBatch(row_layout(specs, logit_rows), specs, config, device, pad_slot, all_logits=logit_rows is None)


def _attention_groups(specs: list[ChunkSlots], config: ModelConfig, device: torch.device,
                      pad_slot: int) -> list[AttentionGroup]:
    window = config.sliding_window if any(config.sliding_layers) else None
    groups: list[AttentionGroup] = []
    row, i = 0, 0
    while i < len(specs):
        j = i + 1
        if specs[i].length == 1:  # batch a run of decoding sequences into one group
            while j < len(specs) and specs[j].length == 1:
                j += 1
        members = specs[i:j]
        groups.append(AttentionGroup(
            start=row, batch=len(members), q_len=members[0].length,
            full=_key_view(members, None, device, pad_slot),
            window=_key_view(members, window, device, pad_slot) if window is not None else None,
        ))
        row += sum(s.length for s in members)
        i = j
    return groups


def _key_view(members: list[ChunkSlots], window: int | None, device: torch.device, pad_slot: int) -> KeyView:
    q_len = members[0].length
    ends = [s.start + s.length for s in members]
    # Sliding layers read only the keys some query of the chunk can still see.
    firsts = [max(0, s.start - window + 1) if window is not None else 0 for s in members]
    width = max(end - first for first, end in zip(firsts, ends, strict=True))
    slots = np.full((len(members), width), pad_slot, dtype=np.int64)
    key_pos = np.full((len(members), width), np.iinfo(np.int64).max, dtype=np.int64)
    for b, (spec, first, end) in enumerate(zip(members, firsts, ends, strict=True)):
        slots[b, : end - first] = spec.slots[first:end]
        key_pos[b, : end - first] = np.arange(first, end)
    query_pos = np.stack([np.arange(s.start, s.start + q_len) for s in members])  # [batch, q_len]
    delta = query_pos[:, :, None] - key_pos[:, None, :]  # [batch, q_len, keys]; padding is negative
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    mask = None if allowed.all() else torch.from_numpy(allowed[:, None]).to(device)
    span = None
    if len(members) == 1 and ends[0] - firsts[0] == width and np.array_equal(slots[0], slots[0, 0] + np.arange(width)):
        span = (int(slots[0, 0]), int(slots[0, 0]) + width)
    return KeyView(torch.from_numpy(slots).to(device), mask, span)


def contiguous_step(config: ModelConfig, start: int, length: int, device: torch.device,
                    last_only: bool = True) -> StepBatch:
    """A step for one sequence whose position p lives in slot p (a cache of its own)."""
    spec = ChunkSlots(start, length, np.arange(start + length, dtype=np.int64))
    return build_step([spec], config, device, logit_rows=[length - 1] if last_only else None)
