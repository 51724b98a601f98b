"""BERT-family encoders from Hugging Face directories in the sentence-transformers layout.

An embedding model is config.json + model.safetensors (a BertModel) and modules.json naming
what follows the transformer: the pooling module (its config gives the mode), optionally a
Dense module (its own safetensors) and a Normalize module. A cross-encoder reranker is a
BertForSequenceClassification: BERT's pooler and a classifier score a (query, document) pair,
through the activation its config names (sentence-transformers' default: a sigmoid for one label).

Every count is bounded, every tensor's name and shape checked against the config before one
is read, and only safetensors are read (pickled `pytorch_model.bin` files are refused).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from llorch.errors import ModelFileError
from llorch.models.encoder import Encoder
from llorch.models.encoder_config import POOLINGS, EncoderConfig
from llorch.weights import limits
from llorch.weights.hf_model import SafetensorsCheckpoint
from llorch.weights.limits import bounded_int, finite_float
from llorch.weights.tokenizer import Tokenizer, read_json_object, tokenizer_from_hf_dir

log = logging.getLogger("llorch.weights")

ENCODER_MODEL_TYPES = ("bert",)
# sentence-transformers' pooling modes (both its config spellings) -> ours; others are refused by name.
POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
LEGACY_POOLING_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                       "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean"}
# torch activation classes a config may name (Dense modules, cross-encoder scores) -> ours.
ACTIVATION_CLASSES = {"Tanh": "tanh", "Identity": "identity", "Sigmoid": "sigmoid"}
# Checkpoint prefixes and module names -> ours (see models/encoder.py).
LAYER_PARTS = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
               "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
               "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}
EMBEDDING_PARTS = {"embeddings.word_embeddings": "word_embeddings",
                   "embeddings.position_embeddings": "position_embeddings",
                   "embeddings.token_type_embeddings": "token_type_embeddings",
                   "embeddings.LayerNorm": "embedding_norm", "pooler.dense": "pooler", "classifier": "classifier"}
POSITIONS = "position_embeddings.weight"


@dataclass
class LoadedEncoder:
    name: str
    path: Path
    config: EncoderConfig
    model: Encoder
    tokenizer: Tokenizer
    dtype: torch.dtype

    @property
    def model_id(self) -> str:
        return self.path.name

    @property
    def kind(self) -> str:
        """What the model is served for: "embed" or "rerank"."""
        return "rerank" if self.config.pooling == "rank" else "embed"


def is_encoder(directory: Path) -> bool:
    """Whether a model directory holds an encoder (its config.json's model_type)."""
    file = directory / "config.json"
    return file.is_file() and read_json_object(file).get("model_type") in ENCODER_MODEL_TYPES


def load_encoder(directory: Path, device: torch.device, dtype: torch.dtype, pooling: str | None = None
                 ) -> LoadedEncoder:
    """The encoder of a directory, with its tokenizer; `pooling` overrides what its files say."""
    config = encoder_config(directory, pooling)
    tokenizer = tokenizer_from_hf_dir(directory, None, set())
    largest = tokenizer.backend.get_vocab_size(with_added_tokens=True) - 1
    if largest >= config.vocab_size:
        raise ModelFileError(directory, f"the tokenizer produces token id {largest}, but the embedding holds only "
                             f"{config.vocab_size} tokens")
    with torch.device("meta"):
        skeleton = Encoder(config)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    state = _state_dict(directory, config, expected)
    skeleton.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
    skeleton.fuse_projections()
    model = skeleton.to(device).eval().requires_grad_(False)
    return LoadedEncoder(directory.name, directory, config, model, tokenizer, dtype)


def encoder_config(directory: Path, pooling: str | None) -> EncoderConfig:
    file = directory / "config.json"
    raw = read_json_object(file)

    def count(key: str, low: int, high: int, default: int | None = None) -> int:
        value = raw.get(key, default)
        if value is None:
            raise ModelFileError(file, f"has no {key!r}")
        return bounded_int(value, key, low, high, file)

    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelFileError(file, f"position_embedding_type {raw['position_embedding_type']!r} is not supported "
                             "(only absolute positions)")
    activation = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(raw.get("hidden_act"))
    if activation is None:
        raise ModelFileError(file, f"activation {raw.get('hidden_act')!r} is not supported")
    hidden, heads = count("hidden_size", 1, limits.MAX_WIDTH), count("num_attention_heads", 1, limits.MAX_HEADS)
    if hidden % heads:
        raise ModelFileError(file, f"hidden_size {hidden} does not split into {heads} attention heads")
    positions = count("max_position_embeddings", 1, limits.MAX_CONTEXT)
    classifies = any(a == "BertForSequenceClassification" for a in raw.get("architectures") or [])
    labels = bounded_int(raw.get("num_labels", len(raw.get("id2label") or {0: 0})), "num_labels", 1, 1 << 16, file)
    found = "rank" if classifies else _st_pooling(directory)
    chosen = pooling or found
    if chosen not in POOLINGS:
        raise ModelFileError(directory, f"pooling {chosen!r} is not supported (supported: {', '.join(POOLINGS)})")
    if (chosen == "rank") != classifies:
        raise ModelFileError(directory, f"--pooling {chosen} needs " + (
            "a classification head (BertForSequenceClassification)" if chosen == "rank" else
            "an embedding model; this is a cross-encoder reranker (BertForSequenceClassification)"))
    config = EncoderConfig(
        architecture="bert", vocab_size=count("vocab_size", 1, limits.MAX_VOCAB), hidden_size=hidden,
        num_layers=count("num_hidden_layers", 1, limits.MAX_LAYERS), num_heads=heads,
        intermediate_size=count("intermediate_size", 1, limits.MAX_WIDTH),
        context_length=min(positions, _trained_length(directory, positions)),
        type_vocab_size=count("type_vocab_size", 1, 1 << 10, default=2),
        layer_norm_eps=finite_float(raw.get("layer_norm_eps", 1e-12), "layer_norm_eps", file),
        activation=activation, pooling=chosen, num_labels=labels if classifies else 0,
        score_activation=_score_activation(raw, labels, file) if classifies else "identity",
        matryoshka_dimensions=_matryoshka(raw, hidden, file))
    if not classifies:
        config = replace(config, **_st_modules(directory, hidden))
    return config


def _modules(directory: Path) -> list[dict[str, Any]]:
    """modules.json's entries (none: a bare transformers checkpoint), each with its kind: the type's last name."""
    file = directory / "modules.json"
    if not file.is_file():
        return []
    try:
        entries = json.loads(file.read_text()) if file.stat().st_size <= limits.DEFAULT_JSON_BYTES else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(file, f"is not valid JSON ({exc})") from exc
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("type"), str)
                                                for e in entries) or len(entries) > 64:
        raise ModelFileError(file, "is not a list of at most 64 modules, each with a type")
    modules = []
    for entry in entries:
        path = entry.get("path", "")
        if not isinstance(path, str) or ".." in Path(path).parts or path.startswith("/"):
            raise ModelFileError(file, f"module path {path!r} points outside the model directory")
        modules.append({**entry, "kind": entry["type"].rsplit(".", 1)[-1]})
    return modules


def _st_pooling(directory: Path) -> str:
    """The pooling module's mode; a directory without modules.json pools by mean (sentence-transformers' default)."""
    for module in _modules(directory):
        if module["kind"] != "Pooling":
            continue
        file = directory / module["path"] / "config.json"
        raw = read_json_object(file)
        mode = raw.get("pooling_mode")
        if mode is None:
            chosen = [name for key, name in LEGACY_POOLING_KEYS.items() if raw.get(key)]
            mode = chosen[0] if len(chosen) == 1 else "+".join(chosen) or None
        ours = POOLING_MODES.get(mode) if isinstance(mode, str) else None
        if ours is None:
            raise ModelFileError(file, f"pooling mode {mode!r} is not supported (supported: mean, cls, lasttoken)")
        return ours
    return "mean"


def _st_modules(directory: Path, hidden: int, dense: bool = True) -> dict[str, Any]:
    """What follows pooling: a Dense projection (where `dense` allows one) and a Normalize, in modules.json's
    order; anything else is refused."""
    found: dict[str, Any] = {}
    for module in _modules(directory):
        kind = module["kind"]
        if kind in ("Transformer", "Pooling"):
            continue
        if kind == "Normalize":
            found["normalize"] = True
        elif kind == "Dense" and dense and "dense" not in found and "normalize" not in found:
            file = directory / module["path"] / "config.json"
            raw = read_json_object(file)
            inputs = bounded_int(raw.get("in_features"), "in_features", hidden, hidden, file)
            outputs = bounded_int(raw.get("out_features"), "out_features", 1, limits.MAX_WIDTH, file)
            name = str(raw.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
            if name not in ACTIVATION_CLASSES or raw.get("bias", True) is not True:
                raise ModelFileError(file, f"a Dense module with activation {name!r} and bias={raw.get('bias')!r} "
                                   "is not supported (Tanh, Identity or Sigmoid, with a bias)")
            found["dense"] = (inputs, outputs, ACTIVATION_CLASSES[name])
            found["dense_path"] = module["path"]
        else:
            raise ModelFileError(directory / "modules.json", f"module {module['type']} is not supported here")
    found.pop("dense_path", None)
    return found


def sentence_modules(directory: Path) -> tuple[str, bool] | None:
    """A decoder's sentence-transformers modules (an embedding model built on a generating one): its pooling and
    whether it normalizes; None without modules.json. A Dense module is refused."""
    if not (directory / "modules.json").is_file():
        return None
    after = _st_modules(directory, 0, dense=False)
    return _st_pooling(directory), bool(after.get("normalize"))


def _trained_length(directory: Path, positions: int) -> int:
    """The longest text the model was trained on: sentence-transformers' max_seq_length, else the tokenizer's
    model_max_length where it is a real length, else the position table's size."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        value = read_json_object(directory / name, required=False).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= positions:
            return value
    return positions


def _matryoshka(raw: dict[str, Any], hidden: int, file: Path) -> tuple[int, ...]:
    """config.json's `matryoshka_dimensions`: the lengths the model was trained to be cut to."""
    value = raw.get("matryoshka_dimensions") or []
    if not isinstance(value, list) or len(value) > 64:
        raise ModelFileError(file, "matryoshka_dimensions is not a list of at most 64 lengths")
    return tuple(sorted({bounded_int(v, "matryoshka_dimensions", 1, hidden, file) for v in value}))


def _score_activation(raw: dict[str, Any], labels: int, file: Path) -> str:
    settings = raw.get("sentence_transformers")
    named = settings.get("activation_fn") if isinstance(settings, dict) else raw.get(
        "sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid" if labels == 1 else "identity"
    activation = ACTIVATION_CLASSES.get(str(named).rsplit(".", 1)[-1])
    if activation is None:
        raise ModelFileError(file, f"score activation {named!r} is not supported (Sigmoid, Identity or Tanh)")
    return activation


def _our_name(name: str) -> str | None:
    """A checkpoint tensor's name in our Encoder, or None when it is not one of BERT's."""
    name = name.removeprefix("bert.")
    if name.startswith("encoder.layer."):
        number, rest = name.removeprefix("encoder.layer.").split(".", 1)
        part, _, leaf = rest.rpartition(".")
        if part in LAYER_PARTS and number.isdigit():
            return f"layers.{number}.{LAYER_PARTS[part]}.{_leaf(leaf)}"
        return None
    part, _, leaf = name.rpartition(".")
    return f"{EMBEDDING_PARTS[part]}.{_leaf(leaf)}" if part in EMBEDDING_PARTS else None


def _leaf(leaf: str) -> str:
    return {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # LayerNorm's names in older checkpoints


def _state_dict(directory: Path, config: EncoderConfig, expected: dict[str, tuple[int, ...]]
                ) -> dict[str, torch.Tensor]:
    """Every weight the encoder takes, checked by name and shape against `expected` before any is read."""
    checkpoint = SafetensorsCheckpoint(directory)
    ours: dict[str, str] = {}
    for name, shape in checkpoint.shapes.items():
        mine = _our_name(name)
        if mine is None:
            raise ModelFileError(directory, f"has weight {name}, which a BERT encoder does not have")
        if mine.startswith("pooler.") and config.pooling != "rank":
            continue  # BERT's pooler is only used by the classification head
        if mine == POSITIONS and len(shape) == 2 and shape[0] >= config.context_length:
            shape = (config.context_length, shape[1])  # the table may outlast the length the model was trained for
        _check(directory, name, mine, shape, expected)
        ours[name] = mine
    state: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.tensors():
        if name in ours:
            state[ours[name]] = tensor[: config.context_length] if ours[name] == POSITIONS else tensor
    if config.dense is not None:
        dense_dir = next(directory / m["path"] for m in _modules(directory) if m["kind"] == "Dense")
        dense = SafetensorsCheckpoint(dense_dir)
        for name, shape in dense.shapes.items():
            mine = {"linear.weight": "dense.weight", "linear.bias": "dense.bias"}.get(name)
            if mine is None:
                raise ModelFileError(dense_dir, f"has weight {name}, which a Dense module does not have")
            _check(dense_dir, name, mine, shape, expected)
        state.update((f"dense.{name.removeprefix('linear.')}", tensor) for name, tensor in dense.tensors())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelFileError(directory, f"weight {missing[0]} is missing")
    return state


def _check(path: Path, name: str, mine: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> None:
    if mine not in expected:
        raise ModelFileError(path, f"has weight {name}, which the config does not describe")
    if shape != expected[mine]:
        raise ModelFileError(path, f"weight {name} has shape {shape}, the config implies {expected[mine]}")
