"""The vocabulary as the grammar engine reads it: every token's bytes, spelled from the tokenizer.

Handing llguidance each token's bytes builds its view in 1-2 s and about 120 MB at 262k
tokens; letting it parse the tokenizer's JSON again took 3 s and kept a second tokenizer.
"""

from __future__ import annotations

from llguidance import LLTokenizer, TokenizerWrapper

from llorch.weights.tokenizer import SPACE_MARK, Tokenizer


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    eos = sorted(tokenizer.eos_token_ids)
    tokens = token_bytes(tokenizer, vocab_size)
    if tokens is None:  # a tokenizer kind we cannot spell byte by byte: let llguidance read its JSON
        return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    return LLTokenizer(TokenizerWrapper(_Vocabulary(tokenizer, tokens)), n_vocab=vocab_size, eos_token=eos)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, and a way to tokenize text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = min(tokenizer.eos_token_ids, default=0)
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._backend = tokenizer.backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._backend.encode(text, add_special_tokens=False).ids


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes] | None:
    """The bytes each token id stands for, or None for a tokenizer that is neither byte-level BPE
    (GPT-2's byte-to-character alphabet) nor SentencePiece-style (U+2581 for a space, <0xNN> byte tokens)."""
    backend = tokenizer.backend
    decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
    byte_level = '"ByteLevel"' in decoder
    if not byte_level and SPACE_MARK not in decoder and '"Metaspace"' not in decoder:
        return None
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    from_char = {c: b for b, c in byte_level_alphabet().items()}
    tokens = [b""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            continue
        if i in added:
            tokens[i] = added[i].encode()
        elif byte_level:
            tokens[i] = bytes(from_char[c] for c in text) if all(c in from_char for c in text) else text.encode()
        elif i in tokenizer.byte_token_ids:
            tokens[i] = bytes([int(text[3:5], 16)])
        else:
            tokens[i] = text.replace(SPACE_MARK, " ").encode()
    return tokens


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the rest map past U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet
