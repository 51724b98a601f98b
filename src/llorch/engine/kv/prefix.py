"""Prefix-cache addresses: a full block is named by a hash of every token up to its end.

Two sequences whose prompts start alike get the same hashes for their shared full
blocks, so the second can reuse the first one's keys and values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence


def chain_hash(parent: bytes, tokens: Iterable[int], prompt_rows: int = 0) -> bytes:
    """The address of a full block: its tokens and, through `parent`, every token before them; and how many of
    them were computed as prompt rows (Sequence.prompt_rows), whose keys and values differ in their last bits:
    a hit then gives exactly what computing the block would."""
    marked = array("q", [-1, prompt_rows]).tobytes() if prompt_rows else b""
    return hashlib.blake2b(parent + array("q", tokens).tobytes() + marked, digest_size=16).digest()


class PrefixHashes:
    """One sequence's block addresses, extended as its tokens grow (each block is hashed once)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: list[bytes] = []

    def of(self, token_ids: Sequence[int], prompt_rows: int = 0) -> list[bytes]:
        """The addresses of every full block of `token_ids` (a prefix of earlier calls' ids, or longer), whose
        first `prompt_rows` were computed as prompt rows."""
        size = self.block_size
        for i in range(len(self._hashes), len(token_ids) // size):
            parent = self._hashes[-1] if self._hashes else b""
            marked = min(max(prompt_rows - i * size, 0), size)
            self._hashes.append(chain_hash(parent, token_ids[i * size : (i + 1) * size], marked))
        return self._hashes
