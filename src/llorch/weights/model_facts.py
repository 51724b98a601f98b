"""What a served model is, for listings (Ollama's /api/tags and /api/show): its file's format, size,
digest, date and quantization, and its parameter count from its shapes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import gguf

from llorch.errors import StartupError
from llorch.models.config import ModelConfig
from llorch.weights.converted import file_sha256
from llorch.weights.gguf import GGUFFile


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "gguf" or "safetensors"
    size: int  # bytes on disk (or, when the file is unknown, of the weights in memory)
    digest: str  # sha256 of the file; of the listing for a directory; "" when unknown
    modified_at: str  # ISO 8601, UTC
    quantization_level: str  # "Q4_K_M", "F16", ... or "unknown"
    parameter_count: int


def parameter_count(config: ModelConfig) -> int:
    """The decoder's parameters, from its shapes (norms and biases included)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (q + 2 * kv) + q * config.hidden_size
    attention += (q + 2 * kv) * config.qkv_bias + config.hidden_size * config.o_bias
    attention += 2 * config.head_dim * config.qk_norm
    norms = config.hidden_size * (4 if config.sandwich_norms else 2)
    layer = attention + 3 * config.hidden_size * config.intermediate_size + norms
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * layer + config.hidden_size


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def unknown_facts(parameters: int, weight_bytes: int) -> ModelFacts:
    """Placeholders for a model whose file is not known: its size in memory, no digest, the time of asking."""
    return ModelFacts("gguf", weight_bytes, "", utc_now(), "unknown", parameters)


def read_model_facts(path: Path, parameters: int) -> ModelFacts:
    """A GGUF file's size, sha256 (cached since loading computed it) and quantization; a Hugging Face
    directory's size, a digest of its listing (not of gigabytes of weights) and dtype."""
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    count = parameters
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        listing = "\n".join(f"{p.name} {p.stat().st_size}" for p in files)
        settings = json.loads((path / "config.json").read_text())
        dtype = str(settings.get("torch_dtype") or settings.get("dtype") or "unknown").upper()
        return ModelFacts("safetensors", sum(p.stat().st_size for p in files),
                          hashlib.sha256(listing.encode()).hexdigest(), modified, dtype.replace("FLOAT", "F"), count)
    file_type = GGUFFile(path).metadata.get("general.file_type")
    try:
        level = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        level = ""
    return ModelFacts("gguf", path.stat().st_size, file_sha256(path), modified, level or "unknown", count)


def facts_or_unknown(path: Path | None, parameters: int, weight_bytes: int) -> ModelFacts:
    """The file's facts, or what the model's shapes alone say when the file cannot be read (or there is none)."""
    try:
        facts = read_model_facts(path, parameters) if path else None
    except (OSError, ValueError, StartupError):
        facts = None
    return facts or unknown_facts(parameters, weight_bytes)
