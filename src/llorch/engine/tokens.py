"""What the HTTP and cluster layers may ask of the tokenizer, through the engine (`Engine.tokens`).

Token ids decoded and spelled, and which ids are special; the tokenizer itself (and its
backend) stays behind the front door, so the API cannot come to depend on its internals.
"""

from __future__ import annotations

from collections.abc import Sequence

from llorch.engine.vocabulary import byte_level_alphabet
from llorch.weights.tokenizer import Tokenizer

# Byte-level BPE spells every byte as one character of this alphabet; reversed, it gives a token's bytes back.
_BYTE_OF_CHAR = {char: byte for byte, char in byte_level_alphabet().items()}


class TokenFacts:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def special_ids(self) -> frozenset[int]:
        return self._tokenizer.special_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._tokenizer.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special=skip_special)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text` (a special marker, say), or None."""
        return self._tokenizer.backend.token_to_id(text)

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """A token's own bytes, which may be part of a character (a byte-fallback token, or a byte-level BPE
        token that splits a character: its text alone would be U+FFFD). `text`: the token's text, when known."""
        tokenizer = self._tokenizer
        if token_id in tokenizer.byte_token_ids:  # "<0xC3>"
            return bytes([int(tokenizer.backend.id_to_token(token_id)[3:5], 16)])
        text = tokenizer.token_text(token_id) if text is None else text
        if "\ufffd" in text:
            spelled = tokenizer.backend.id_to_token(token_id) or ""
            if spelled and all(c in _BYTE_OF_CHAR for c in spelled):
                return bytes(_BYTE_OF_CHAR[c] for c in spelled)
        return text.encode()
