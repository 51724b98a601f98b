"""How faithful each engine is to the model file: KL divergence against the file computed exactly.

The exact reference is the same GGUF file dequantized and computed in float32 (llorch's
--dequantize path, which the test suite checks against transformers). Over 256 tokens of
real English text (CPython's licence), teacher-forced, every engine's next-token
distribution at every position is compared with the reference's: mean KL(reference ||
engine) and how often the top token agrees. The same token ids go to every engine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llorch.engine.kv.pool import allocate_kv
from llorch.models.step_batch import contiguous_step
from llorch.weights.loader import LoadedModel, load_model

TOKENS = 256


def english_text() -> str:
    return Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                "LICENSE.txt").read_text(encoding="utf-8")


def log_probs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Log-softmax of the model's logits at every position of `ids` (one prompt pass)."""
    dtype = torch.float16 if loaded.native is not None else loaded.dtype  # the C step keeps float16 keys and values
    cache = allocate_kv(loaded.config, len(ids), dtype, torch.device("cpu"), zeroed=True)
    step = contiguous_step(loaded.config, 0, len(ids), torch.device("cpu"), last_only=False)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids), step, cache)
    return torch.log_softmax(logits.double(), -1)


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    kl = (reference.exp() * (reference - candidate)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
            "top1_agreement": float((reference.argmax(-1) == candidate.argmax(-1)).double().mean())}


def llama_cpp_log_probs(llama_cpp: Any, model: Path, ids: list[int], threads: int) -> torch.Tensor:
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=len(ids) + 8, n_batch=len(ids), n_ubatch=len(ids),
                          n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float64)
    return torch.log_softmax(torch.from_numpy(scores), -1)


def measure(model: Path, threads: int, llama_cpp: Any | None) -> dict[str, Any]:
    """KL and top-1 agreement of llorch's served path (and llama.cpp's, when given) against the exact file."""
    exact = load_model(model, torch.device("cpu"), torch.float32)
    ids = exact.tokenizer.encode(english_text())[:TOKENS + 1]
    reference = log_probs(exact, ids)
    del exact
    served = load_model(model, torch.device("cpu"), torch.float32, keep_quantized=True)
    figures: dict[str, Any] = {"tokens": len(ids), "llorch": compare(reference, log_probs(served, ids))}
    del served
    if llama_cpp is not None:
        figures["llama.cpp"] = compare(reference, llama_cpp_log_probs(llama_cpp, model, ids, threads))
    return figures
