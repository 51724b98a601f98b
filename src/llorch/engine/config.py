"""How an engine is configured: one frozen EngineConfig, built from a worker's flags (`from_args`) or in code.

Building an engine from it (and the policies that size it) is the factory's work (factory.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # --dtype's choices besides auto
DTYPES = tuple(TORCH_DTYPES)
DEFAULT_CPU_KV_MB = 512
DEFAULT_CUDA_KV_FRACTION = 0.5
SPECULATIVE_MODES = ("ngram", "draft", "off")
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."  # start-up's proof that a model computes finite values
DEFAULT_SPECULATIVE_TOKENS = 16
# (max_running, max_queue, max_batch_tokens) by kind. A generating job holds a slot for its whole life; a pooled
# one (an embedding, a rerank pair) for one step, and a request brings up to 2048 of them at once. An encoder
# step reads whole texts, as many as fit its tokens.
KIND_LIMITS = {"generate": (16, 64, 512), "pooled": (64, 4096, 8192)}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # GGUF file or Hugging Face directory; None: the embedded default model
    dtype: str = "auto"  # auto | f32 | bf16 | f16
    ctx_size: int | None = None  # prompt + generated tokens per job; None: the model's context
    # None: the default of the model's kind (KIND_LIMITS), resolved by the factory.
    max_running: int | None = None  # jobs batched into one forward step
    max_queue: int | None = None  # jobs that may wait for a slot
    max_batch_tokens: int | None = None  # prompt tokens read per step
    kv_cache_bytes: int | None = None  # None: the device's default, at most max_running full contexts
    prefix_caching: bool = True
    request_timeout: float | None = None
    max_prompt_tokens: int | None = None
    dequantize: bool = False  # hold GGUF weights dense in the compute dtype (the cpu worker's --dequantize)
    chat_template_file: str | None = None
    # Proposals verified per decoding step: "ngram" (lookup in the job's own text), "draft" (a draft model's)
    # or "off". None: "draft" with a draft model, else "ngram" where the compute path gives a row the same
    # bits in any chunk (so speculation never changes a token).
    speculative: str | None = None
    draft_model: str | None = None  # GGUF file or Hugging Face directory of the same vocabulary
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # proposals per row and step, at most
    pooling: str | None = None  # an embedding model's pooling (mean, cls, last) or rank; None: its files'
    grammar_at_start: bool = False  # build the grammar engine's vocabulary view while loading, not on first use

    def c_step_on(self, device: str) -> bool:
        """Whether a GGUF file of a generating model is served by the C step here: on the CPU, in float32,
        its weights in their blocks (the factory loads anything else with torch)."""
        return device == "cpu" and not self.dequantize and self.dtype in ("auto", "f32")

    def with_limits(self, kind: str) -> EngineConfig:
        """The batching limits the operator left unset, at the defaults of the model's kind."""
        running, queued, tokens = KIND_LIMITS["generate" if kind == "generate" else "pooled"]
        return replace(self, max_running=self.max_running or running, max_queue=queued if self.max_queue is None
                       else self.max_queue, max_batch_tokens=self.max_batch_tokens or tokens)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(model=args.model, dtype=args.dtype, ctx_size=args.ctx_size, max_running=args.max_running,
                   max_queue=args.max_queue, max_batch_tokens=args.max_batch_tokens,
                   kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb is not None else None,
                   prefix_caching=not args.no_prefix_cache, request_timeout=args.request_timeout,
                   max_prompt_tokens=args.max_prompt_tokens, dequantize=getattr(args, "dequantize", False),
                   chat_template_file=args.chat_template_file, speculative=args.speculative,
                   draft_model=args.draft_model, speculative_tokens=args.speculative_tokens,
                   pooling=getattr(args, "pooling", None), grammar_at_start=args.grammar_at_start)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    import torch

    if choice != "auto":
        return getattr(torch, TORCH_DTYPES[choice])
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # float32 on every CPU, measured rather than inferred from a flag: the int8 kernels compute in
    # float32 (bf16 activations were 30% slower even with AVX512-BF16), and dense weights keep the
    # file's exact numbers. `--dtype bf16` trades those numbers for dense-weight speed.
    return torch.float32
