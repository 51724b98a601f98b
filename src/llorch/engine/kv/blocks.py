"""Bookkeeping of the paged KV pool: which blocks are free, who holds which, which prefixes are cached.

The pool's tensors live in pool.py; this module only hands out block numbers. A
sequence owns a block table (its blocks in position order). Full blocks are
addressed by their prefix hash (prefix.py), so two prompts that share a prefix
share those blocks (reference counted). A block whose last holder finished stays cached until its memory is
needed: free blocks without a hash are handed out first, then cached ones, least
recently released first.

Block 0 is never handed out: the runner keeps it zeroed and pads gathers with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least two blocks (one is the padding block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        # Free blocks that hold nothing reusable; popped from the end, lowest numbers first.
        self._blank = list(range(num_blocks - 1, NULL_BLOCK, -1))
        # Free blocks that still hold a cached prefix, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    # -- capacity -----------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._blank) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A block for one holder, or None when every block is held."""
        if self._blank:
            block = self._blank.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            return None
        self._refs[block] = 1
        return block

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one holder's reference to each block; unheld blocks become free (cached ones stay cached)."""
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released more often than taken"
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._blank.append(block)

    # -- prefix cache -----------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, without taking them."""
        found: list[int] = []
        if self.prefix_caching:
            for digest in hashes:
                block = self._by_hash.get(digest)
                if block is None:
                    break
                found.append(block)
        return found

    def free_among(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are free now (taking them would shrink the free count)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take(self, blocks: Iterable[int]) -> None:
        """Share cached blocks found by `lookup`."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, digest: bytes) -> None:
        """Record that `block` now holds the full block addressed by `digest`."""
        if not self.prefix_caching or digest in self._by_hash or block in self._hash_of:
            return
        self._by_hash[digest] = block
        self._hash_of[block] = digest
