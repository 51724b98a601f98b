"""Bounds on what a model file may claim, checked before anything is sized by it.

Model files are untrusted input. A count in a header (layers, heads, widths) sizes
loops and allocations, so each one is read through `bounded_int` first: of the right
type, finite, and within limits far above every released model but far below what
would exhaust the machine. Every refusal is a ModelFileError naming the value.
"""

from __future__ import annotations

import math
import stat
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from llorch.errors import ModelFileError

MAX_LAYERS = 1024  # the largest released models have under 200
MAX_WIDTH = 1 << 20  # hidden and intermediate sizes
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_VOCAB = 1 << 20  # 1M tokens; the largest released vocabularies hold 262k
MAX_CONTEXT = 1 << 24  # 16M positions
MAX_TOKEN_CHARS = 1024  # one vocabulary entry; real ones stay under 300
MAX_NAME_CHARS = 256  # a model's display name: sent in every `started` event and /health
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template; real ones stay under 100k
# Checkpoint files of pickled objects, refused by name: loading one can run code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# What one file may hold, checked before its contents become objects. A dense model needs
# about a dozen tensors per layer; llama.cpp's byte-level vocabularies ship about two merges per token.
MAX_TENSORS = 1 << 16  # tensors in one GGUF or safetensors file
MAX_MERGES = 2 * MAX_VOCAB  # tokenizer.ggml.merges; Llama 3 has 280k
MAX_METADATA_KEYS = 1 << 16  # GGUF metadata entries; real files have under 100
MAX_METADATA_KEY_BYTES = (1 << 16) - 1  # a GGUF key or tensor name (the format's own limit for keys)
MAX_METADATA_STRING_BYTES = 4 * MAX_TEMPLATE_CHARS  # one GGUF string value: a chat template in UTF-8
MAX_METADATA_ARRAY_STRINGS = 1 << 16  # a GGUF string array other than the vocabulary and its merges
MAX_METADATA_ARRAY_BYTES = 64 << 20  # the text of every GGUF string array together (a 262k vocabulary: ~3 MB)
# A GGUF header (metadata and tensor table; Gemma 3's 262k vocabulary makes one of ~6 MB), and the bytes a
# file may hold after its last tensor. Checked before the file is read whole for its digest: a sparse file
# claiming gigabytes there would otherwise cost seconds of hashing for nothing the model needs.
MAX_GGUF_HEADER_BYTES = 256 << 20
MAX_GGUF_TRAILING_BYTES = 1 << 20
# GGUF arrays the vocabulary sizes: their counts are checked before their elements are read.
VOCABULARY_ARRAYS = {
    "tokenizer.ggml.tokens": MAX_VOCAB,
    "tokenizer.ggml.scores": MAX_VOCAB,
    "tokenizer.ggml.token_type": MAX_VOCAB,
    "tokenizer.ggml.merges": MAX_MERGES,
}

# JSON files of a model directory, by name: each a few times the largest real one, so that
# parsing even a file of nothing but empty lists stays within a few hundred MB.
JSON_FILE_BYTES = {
    "config.json": 1 << 20,  # real ones: a few kB
    "generation_config.json": 1 << 20,  # real ones: under 1 kB
    "tokenizer_config.json": 4 << 20,  # Gemma 3's lists its 6k added tokens in 1.2 MB
    "model.safetensors.index.json": 4 << 20,  # a 1024-layer dense model's weight_map: about 1.5 MB
}
DEFAULT_JSON_BYTES = 1 << 20  # any other JSON file of a model directory
# tokenizer.json is parsed by `tokenizers` (in Rust), whose memory follows the strings the file
# holds (about 280 bytes each): both are bounded before it is built. Gemma 3's, the largest real
# one, holds 1.34M strings (262k tokens, 515k merges) in 33 MB and takes 360 MB to build.
MAX_TOKENIZER_JSON_BYTES = 64 << 20
MAX_TOKENIZER_STRINGS = 2 << 20
MAX_SAFETENSORS_HEADER_BYTES = 8 << 20  # real headers hold about 150 bytes per tensor


def bounded_int(value: Any, what: str, low: int, high: int, path: Path) -> int:
    """`value` as an int in [low, high], or a ModelFileError naming `what`.

    Accepts ints (not bools) and integral finite floats (JSON writers sometimes write 4096.0).
    """
    if isinstance(value, bool) or not isinstance(value, Integral | Real):
        raise ModelFileError(path, f"{what} must be an integer, not {_shown(value)}")
    if not isinstance(value, Integral) and not (math.isfinite(value) and float(value).is_integer()):
        raise ModelFileError(path, f"{what} must be an integer, not {_shown(value)}")
    number = int(value)
    if not low <= number <= high:
        raise ModelFileError(path, f"{what} is {number}; it must be between {low} and {high}")
    return number


def finite_float(value: Any, what: str, path: Path, positive: bool = True) -> float:
    """`value` as a finite float (and > 0 when `positive`), or a ModelFileError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ModelFileError(path, f"{what} must be a finite number, not {_shown(value)}")
    if positive and value <= 0:
        raise ModelFileError(path, f"{what} is {value}; it must be greater than 0")
    return float(value)


def bounded_text(value: Any, what: str, limit: int, path: Path) -> str:
    """`value` as a string of at most `limit` characters."""
    if not isinstance(value, str):
        raise ModelFileError(path, f"{what} must be a string, not {_shown(value)}")
    if len(value) > limit:
        raise ModelFileError(path, f"{what} is {len(value)} characters long; at most {limit} are allowed")
    return value


def require_regular_file(path: Path) -> int:
    """The file's size; devices, FIFOs and sockets are refused before anything reads them (/dev/zero
    never ends, a FIFO blocks)."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ModelFileError(path, f"cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ModelFileError(path, "is not a regular file")
    return info.st_size


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
