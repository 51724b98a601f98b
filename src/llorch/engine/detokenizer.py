"""Streaming detokenization that never emits a broken character.

Decoding token by token is wrong for byte-fallback and byte-level vocabularies: one
character may span several tokens. We decode a short window of recent tokens and
emit only text that is complete (no trailing U+FFFD), so the concatenated pieces
equal the decoded output exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = ""  # all text handed out so far

    def add(self, token_id: int) -> str:
        """The new complete text after appending `token_id` ("" while a character is unfinished)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT) or not text.startswith(self._emitted):
            return ""
        piece = text[len(self._emitted) :]
        self._emitted = text
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character decodes as U+FFFD, as in the full text)."""
        text = self._decode(self._ids)
        piece = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return piece
