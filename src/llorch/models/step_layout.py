"""One forward step's rows as plain host arrays, and the KV cache they read: what the C step
takes, without torch (the torch layout in step_batch.py is built from these).

Every layer stores keys and values as `[slots, kv_heads, head_dim]`; a step says, for every
new token, its position and the slot it writes, and for every row, which slots its query reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class LayerKV:
    """One layer's keys and values: [slots, kv_heads, head_dim] each."""

    def __init__(self, keys: Any, values: Any) -> None:  # torch tensors, or numpy arrays for the C step
        self.keys = keys
        self.values = values


@dataclass(frozen=True)
class ChunkSlots:
    """A chunk (one sequence's share of a step) as attention places it: `length` new tokens after `start`
    cached ones."""

    start: int
    length: int
    slots: np.ndarray  # the slot of every position 0 .. start + length - 1, maybe more after (int64)


@dataclass(frozen=True)
class RowLayout:
    """The step's rows as plain host arrays: what a C step reads (and the torch layout is built from).
    row_layout builds every one C-contiguous int64, so the C step takes them as they are."""

    positions: np.ndarray  # [N] absolute position of every new token
    write_slots: np.ndarray  # [N] where every new token's key and value are written
    slots: np.ndarray  # every chunk's slots for its positions 0 .. end - 1, concatenated
    slot_start: np.ndarray  # [N] where each row's chunk starts in `slots`
    logit_rows: np.ndarray  # rows whose logits are wanted



def row_layout(specs: list[ChunkSlots], logit_rows: list[int] | None = None) -> RowLayout:
    """The step's rows, in order of its chunks; `logit_rows` None wants every row's logits."""
    if all(s.length == 1 for s in specs):
        return _decoding_layout(specs, logit_rows)
    positions = np.concatenate([np.arange(s.start, s.start + s.length) for s in specs])
    write_slots = np.concatenate([s.slots[s.start : s.start + s.length] for s in specs])
    starts = np.cumsum([0] + [s.start + s.length for s in specs[:-1]])
    slot_start = np.repeat(starts, [s.length for s in specs])
    slots = np.concatenate([s.slots[: s.start + s.length] for s in specs])
    wanted = np.arange(len(positions)) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64)
    return RowLayout(positions.astype(np.int64), write_slots.astype(np.int64), slots.astype(np.int64),
                     slot_start.astype(np.int64), wanted.astype(np.int64))


def _decoding_layout(specs: list[ChunkSlots], logit_rows: list[int] | None) -> RowLayout:
    """Every chunk is one decoding row (the steady state, every token): built from lists, as numpy's
    per-call set-up on arrays this small cost more than the work (about 40 µs a step, cache-cold)."""
    starts, at = [], 0
    for s in specs:
        starts.append(at)
        at += s.start + 1
    wanted = range(len(specs)) if logit_rows is None else logit_rows
    # A lone row reads its first start + 1 slots: those after them are never read.
    slots = specs[0].slots if len(specs) == 1 else np.concatenate([s.slots[: s.start + 1] for s in specs])
    return RowLayout(np.array([s.start for s in specs], dtype=np.int64),
                     np.array([s.slots[s.start] for s in specs], dtype=np.int64),
                     np.ascontiguousarray(slots, dtype=np.int64), np.array(starts, dtype=np.int64),
                     np.array(wanted, dtype=np.int64))
