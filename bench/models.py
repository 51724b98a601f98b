"""The benchmark's models: the embedded default model, and a Llama-architecture model of about
one billion parameters built on this machine.

Speed does not depend on the weights' values, so the large model has random weights:
transformers initializes a Llama with TinyLlama's shape (22 layers, hidden size 2048,
32 heads over 4 KV heads, MLP 5632, vocabulary 32000: 1.1 billion parameters), llama.cpp's
own converter turns it into GGUF and its `llama-quantize` into Q4_K_M, from the pinned
source (bench/llama_cpp.py). Its tokenizer is a SentencePiece BPE vocabulary (byte
fallback, as Llama 2's) trained on English text found on this machine. The file is
cached between runs (a first build takes a few minutes and about 7 GB of scratch disk).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from llama_build import CACHE, convert_hf_to_gguf, quantize
from llorch.weights.default_model import default_model_path

BILLION = "llama-1.1b-random-q4_k_m.gguf"
# TinyLlama 1.1B's shape: a Llama of about one billion parameters.
BILLION_CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
                  "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TOKENIZER_VOCAB = 8000  # trained on the text this machine has; the model's vocabulary is padded to 32000


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
    """The 1.1B-parameter Llama in Q4_K_M, built on first use and cached."""
    target = CACHE / "models" / BILLION
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        directory = work / "hf"
        _write_random_llama(directory)
        f16 = work / "f16.gguf"
        convert_hf_to_gguf(directory, f16, "f16")
        shutil.rmtree(directory)
        partial = work / BILLION
        quantize(f16, partial, "Q4_K_M")
        partial.replace(target)
    return target


def _write_random_llama(directory: Path) -> None:
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
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **BILLION_CONFIG)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = transformers.LlamaTokenizer(vocab_file=str(directory / "tokenizer.model"), legacy=True)
    tokenizer.save_pretrained(directory)
