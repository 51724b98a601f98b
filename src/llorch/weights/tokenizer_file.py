"""tokenizer.json as the caches keep it: each BPE merge one "left right" string.

`tokenizers` writes merges as pairs, and reading pairs back costs it every pair buffered
twice before the model is built: Gemma 3's 515k merges took 1.0 s and peaked 365 MB above
the process, against 0.65 s and 185 MB as strings. The string form cannot say a token that
holds a space, so a vocabulary with one keeps its pairs. A SentencePiece conversion builds its
BPE without merges and gives them here apart (weights/tokenizer.py says why).
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Inside a JSON string every quote is escaped, so this text is the merges key and nothing else.
MERGES_KEY = '"merges":'


def save_tokenizer(backend: HFTokenizer, target: Path, merges: list[tuple[str, str]] | None = None) -> None:
    """`backend` as JSON; `merges`: its BPE merges when it was built without them (written in their place)."""
    text = backend.to_str()
    key = text.rfind(MERGES_KEY)
    start = key + len(MERGES_KEY)
    if merges is not None:
        if key < 0 or not text.startswith("[]", start):
            raise ValueError("a tokenizer saved with merges given apart must have none of its own")
        pairs, end = merges, start + 2
    elif key >= 0:  # only the merges are decoded and written again: the rest is left as `tokenizers` wrote it
        decoded, end = json.JSONDecoder().raw_decode(text, start)
        pairs = decoded if all(isinstance(m, list) and len(m) == 2 for m in decoded) else []
    else:
        pairs = []
    if pairs:
        # A token that holds a space cannot be one side of a "left right" string: then every merge stays a pair.
        spaced = " " in "\n".join(chain.from_iterable(pairs))  # one scan: a million `in`s took 0.2 s
        joined = (json.dumps([list(pair) for pair in pairs], ensure_ascii=False) if spaced
                  else json.dumps([f"{left} {right}" for left, right in pairs], ensure_ascii=False))
        text = text[:start] + joined + text[end:]
    target.write_text(text, encoding="utf-8")
