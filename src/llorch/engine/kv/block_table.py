"""One sequence's share of the KV pool: its blocks in position order, and how far they are filled."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Tokens [0, computed) of a sequence are in `blocks`; the first `registered` full blocks
    are already offered to the prefix cache."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.computed = 0
        self.registered = 0

    def clear(self) -> list[int]:
        """Forget every block (the caller releases them); returns them."""
        blocks, self.blocks = self.blocks, []
        self.computed = self.registered = 0
        return blocks



def slots_of(blocks: list[int], block_size: int, end: int) -> np.ndarray:
    """The pool slot of every position 0 .. end - 1 of a sequence holding `blocks` (int64)."""
    table = np.asarray(blocks, dtype=np.int64)
    return (table[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)[:end]


class SlotCache:
    """Each block table's slots, kept from one step to the next.

    A decoding sequence's table changes once per block_size tokens, but its slots were built
    again every step: four numpy calls that cost about 0.3 ms a token once the step's weight
    stream had pushed numpy out of the caches. An entry is found by the list's identity and
    used only while the list still holds the same blocks, so a reused identity or a changed
    table is built anew."""

    LIMIT = 1024  # entries before the cache starts over (the tables of ended sequences go with them)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tables: dict[int, tuple[list[int], np.ndarray, int]] = {}

    def slots(self, blocks: list[int]) -> np.ndarray:
        """The slot of every position the blocks hold (len(blocks) * block_size of them, int64)."""
        return self._entry(blocks)[1]

    def address(self, blocks: list[int]) -> int:
        """Where slots(blocks) lies in memory, for the C step (asked of numpy once per entry)."""
        return self._entry(blocks)[2]

    def _entry(self, blocks: list[int]) -> tuple[list[int], np.ndarray, int]:
        kept = self._tables.get(id(blocks))
        if kept is not None and kept[0] == blocks:
            return kept
        if len(self._tables) >= self.LIMIT:
            self._tables.clear()
        slots = slots_of(blocks, self.block_size, len(blocks) * self.block_size)
        entry = self._tables[id(blocks)] = (list(blocks), slots, slots.ctypes.data)
        return entry
