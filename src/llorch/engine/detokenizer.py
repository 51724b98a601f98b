"""Streaming detokenization: exact, never a broken character, O(1) work per token.

Decoding token by token is wrong for byte-fallback and byte-level vocabularies (one
character may span several tokens), and decoding the whole output again at every
token costs O(n). We decode a short window instead: the tokens since the last point
where the text was final (`_window`), plus those that came after (`_read`):

    emitted piece = decode(window + new tokens) minus decode(window)

The window starts at a clean boundary, so decoding from there gives the same text as
the full output has from there; both decodes start at the same token, so a decoder
that strips a leading space (SentencePiece's dummy prefix) strips it from both. Text
is held back while it is not final:
- it ends in U+FFFD: an unfinished character (byte-level and byte-fallback vocabularies);
- the last token is a byte-fallback token: the decoder turns a whole run of byte tokens
  into text at once, and a later invalid byte turns earlier bytes of the same run into
  U+FFFD too. A run is final once a normal token follows it (special tokens, which
  decode to nothing, do not end a run).
The window only moves past tokens that produced text, so it never starts with tokens
that decode to nothing (a leading-space strip would then hit the new text instead).

The window's own text is kept from the decode that emitted it, so a token costs one decode,
not two: the window grows by the emitted tokens (its start stays a clean boundary) and moves
up to them only every WINDOW_TOKENS tokens, when its text is decoded once again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT = "\ufffd"
WINDOW_TOKENS = 8  # the longest window before it moves up (each decode reads it: kept short)


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
        self._window: list[int] = []  # final tokens whose text was emitted, the decode context
        self._read: list[int] = []  # tokens after the window, not yet emitted
        self._window_text = ""  # decode(window)
        self._text = ""  # decode(window + read), from the last _piece

    def add(self, token_id: int) -> str:
        """The new final text after appending `token_id` ("" while it is not final yet)."""
        self._read.append(token_id)
        if token_id not in self._silent_ids:
            self._in_byte_run = token_id in self._byte_ids
        if self._in_byte_run:
            return ""
        piece = self._piece()
        if piece is None or piece.endswith(REPLACEMENT):
            return ""
        self._advance(piece)
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character decodes as U+FFFD, as in the full text)."""
        piece = self._piece() or ""
        self._advance(piece)
        return piece

    def _piece(self) -> str | None:
        """decode(window + read) minus decode(window); None when the window's text is not its prefix."""
        before = self._window_text
        text = self._text = self._decode(self._window + self._read)
        return text[len(before) :] if text.startswith(before) else None

    def _advance(self, piece: str) -> None:
        """The read tokens are final: they become the window, unless they made no text."""
        # Tokens that made no text (specials, or a space the decoder stripped at the start) stay
        # behind the window's first token: dropping them could change how the rest decodes.
        if piece and len(self._window) + len(self._read) > WINDOW_TOKENS:
            self._window = self._read
            self._window_text = self._decode(self._window)
        else:
            self._window = self._window + self._read
            self._window_text = self._text
        self._read = []
