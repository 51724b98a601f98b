"""Streaming detokenization that never emits a broken character.

Decoding token by token is wrong for byte-fallback and byte-level vocabularies: one
character may span several tokens. We decode the output so far and emit only text
that is final, so the concatenated pieces equal the decoded output exactly:
- text ending in U+FFFD is an unfinished character, held back;
- text after a byte-fallback token is held back too: the decoder turns a whole run
  of byte tokens into text at once, and a later invalid byte can turn earlier bytes
  of the same run into U+FFFD. A run is final once a normal token follows it
  (special tokens, which decode to nothing, do not end a run).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        byte_token_ids: Collection[int] = (),
        silent_ids: Collection[int] = (),
    ) -> None:
        self._decode = decode
        self._byte_ids = byte_token_ids
        self._silent_ids = silent_ids  # ids that decode to no text (skipped special tokens)
        self._in_byte_run = False
        self._ids: list[int] = []
        self._emitted = ""  # all text handed out so far

    def add(self, token_id: int) -> str:
        """The new complete text after appending `token_id` ("" while a character is unfinished)."""
        self._ids.append(token_id)
        if token_id not in self._silent_ids:
            self._in_byte_run = token_id in self._byte_ids
        if self._in_byte_run:
            return ""
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
