"""Which replica last read a prompt's prefix, so that requests sharing it reuse its KV blocks.

The front sees text, not tokens: a prompt is cut into blocks of characters, each block keyed by a
hash of itself and every block before it (as the engine's prefix cache keys token blocks). The
replica recorded for the deepest known key is the one holding the longest shared prefix.
Ray Serve ships a prefix-aware router only inside its LLM package, which needs vLLM or SGLang;
this table is small, local to the front's router, and needs neither.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

BLOCK_CHARS = 64  # about 16 tokens, the engine's KV block
MAX_BLOCKS = 64  # a prefix longer than 4096 characters adds nothing to the choice
MAX_KEYS = 100_000  # least recently used keys beyond this are forgotten


def prefix_keys(text: str) -> Iterator[int]:
    """One key per whole block of `text`, each covering every character before the block's end."""
    key = 0
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        key = hash((key, text[start:start + BLOCK_CHARS]))
        yield key


class PrefixAffinity:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._owner: OrderedDict[int, str] = OrderedDict()

    def lookup(self, text: str, replicas: Collection[str]) -> tuple[str | None, int]:
        """The replica among `replicas` that read the longest prefix of `text`, and that prefix's
        length in characters; (None, 0) when none did."""
        best: tuple[str | None, int] = (None, 0)
        for depth, key in enumerate(prefix_keys(text), 1):
            owner = self._owner.get(key)
            if owner is None:
                break
            if owner in replicas:
                best = (owner, depth * BLOCK_CHARS)
        return best

    def record(self, text: str, replica: str) -> None:
        """`replica` now holds every block of `text`."""
        for key in prefix_keys(text):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)
