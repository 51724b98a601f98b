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
