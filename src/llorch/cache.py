"""The on-disk cache of converted artifacts (tokenizers, repacked weights, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """LLORCH_CACHE_DIR, or ~/.cache/llorch."""
    root = os.environ.get("LLORCH_CACHE_DIR") or Path.home() / ".cache" / "llorch"
    return Path(root)
