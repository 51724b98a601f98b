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
MAX_VOCAB = 1 << 22  # 4M tokens; the largest released vocabularies hold 262k
MAX_CONTEXT = 1 << 24  # 16M positions
MAX_TOKEN_CHARS = 1024  # one vocabulary entry; real ones stay under 300
MAX_NAME_CHARS = 256  # a model's display name: sent in every `started` event and /health
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template; real ones stay under 100k
MAX_JSON_BYTES = 256 << 20  # one JSON file of a model directory (a 262k vocabulary's tokenizer.json is ~33 MB)


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
