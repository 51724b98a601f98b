"""The served model as Ollama names and describes it: `<model id>:latest`, details, model_info, capabilities.

Apart from the routes: what /api/tags, /api/ps and /api/show report about the model, and the
one check on a request's model name (any other name is a 404, as Ollama answers for a model
it does not have).
"""

from __future__ import annotations

from typing import Any

from llorch.api.ollama_errors import OllamaError
from llorch.api.reasoning import reasoning_markers
from llorch.engine.engine import Engine
from llorch.models.encoder_config import EncoderConfig
from llorch.weights.model_facts import ModelFacts

LATEST = ":latest"


def listed_name(engine: Engine) -> str:
    return engine.model_id + LATEST


def check_model(engine: Engine, name: str) -> None:
    """The served model answers to its id, with or without ":latest" (any case); other names are unknown."""
    wanted = name.lower().removesuffix(LATEST)
    if wanted != engine.model_id.lower():
        raise OllamaError(404, f"model '{name}' not found")


def human_count(count: int) -> str:
    """A parameter count as Ollama writes it: 268.10M, 1.1B, 8B."""
    if count >= 10**9:
        value = count / 10**9
        return f"{value:.0f}B" if value == int(value) else f"{value:.1f}B"
    if count >= 10**6:
        return f"{count / 10**6:.2f}M"
    if count >= 10**3:
        return f"{count / 10**3:.0f}K"
    return str(count)


def details(engine: Engine, facts: ModelFacts) -> dict[str, Any]:
    architecture = engine.model_config.architecture
    return {"parent_model": "", "format": facts.format, "family": architecture, "families": [architecture],
            "parameter_size": human_count(facts.parameter_count),
            "quantization_level": facts.quantization_level}


def model_info(engine: Engine, facts: ModelFacts) -> dict[str, Any]:
    """The model's shapes under GGUF's key names, as Ollama reports them (apps read the context length here)."""
    config = engine.model_config
    arch = config.architecture
    info = {"general.architecture": arch, "general.basename": engine.model_name,
            "general.parameter_count": facts.parameter_count,
            f"{arch}.context_length": config.context_length, f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_layers, f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_heads, "general.file_type": facts.quantization_level}
    if isinstance(config, EncoderConfig):
        info.update({f"{arch}.attention.layer_norm_epsilon": config.layer_norm_eps,
                     f"{arch}.pooling_type": config.pooling})
    else:
        info.update({f"{arch}.attention.head_count_kv": config.num_kv_heads,
                     f"{arch}.attention.key_length": config.head_dim, f"{arch}.attention.value_length": config.head_dim,
                     f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
                     f"{arch}.rope.freq_base": config.rope_theta})
    return info


def capabilities(engine: Engine) -> list[str]:
    if engine.kind != "generate":
        return ["embedding"]
    found = ["completion", "tools"]  # every template can call tools (the default convention when it knows none)
    if reasoning_markers(engine.chat_template.source if engine.chat_template else None):
        found.append("thinking")
    return found
