"""The decoder run by the C step (kernels/csrc/decoder.c) instead of torch ops, on the CPU.

NativeDecoder describes a loaded Decoder's weights to the C step once (pointers into the
module's own tensors: GGUF blocks at the file's width, float32 norms and biases) and
runs each forward step as one C call. It serves models computed in float32 whose
projections are GGUF-typed (or float32) matrices; the torch path serves everything else
(CUDA, bf16/f16 compute, dense weights of other dtypes).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from llorch.kernels.build import library
from llorch.kernels.step import LayerDesc, Matrix, ModelDesc, StepDesc
from llorch.models.decoder import Decoder, rope_inverse_frequencies
from llorch.models.quantized import GGUFEmbedding, GGUFLinear
from llorch.models.step_batch import LayerKV, StepBatch

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _matrix(module: nn.Module) -> Matrix:
    if isinstance(module, GGUFLinear | GGUFEmbedding):
        weight, qtype = module.weight, module.qtype
    elif isinstance(module, nn.Linear | nn.Embedding) and module.weight.dtype == torch.float32:
        weight, qtype = module.weight, int(GGMLQuantizationType.F32)  # a float32 row is an F32 row
    else:
        raise TypeError(f"{type(module).__name__} has no form the C step reads")
    if not weight.is_contiguous():
        raise ValueError("a weight the C step reads must be contiguous")
    cols = module.in_features if isinstance(module, nn.Linear | GGUFLinear) else module.embedding_dim
    return Matrix(qtype, 0, weight.data_ptr(), weight.shape[0], cols)


def _pointer(tensor: Tensor | None) -> int | None:
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError("norms and biases the C step reads must be contiguous float32")
    return tensor.data_ptr()


def native_decoder_problem(decoder: Decoder) -> str | None:
    """Why the C step cannot run this decoder, or None when it can."""
    for name, module in decoder.named_modules():
        if not isinstance(module, nn.Linear | nn.Embedding | GGUFLinear | GGUFEmbedding):
            continue
        if isinstance(module, nn.Linear | nn.Embedding) and module.weight.dtype != torch.float32:
            return f"{name} holds {module.weight.dtype} weights"
        if module.weight.device.type != "cpu":
            return f"{name} is not on the CPU"
    if decoder.config.activation not in ACTIVATIONS:
        return f"activation {decoder.config.activation!r}"
    if decoder.config.head_dim % 2 or decoder.config.hidden_size % 32:
        return "the hidden size is not a multiple of 32"
    return None


class NativeDecoder:
    def __init__(self, decoder: Decoder) -> None:
        problem = native_decoder_problem(decoder)
        if problem:
            raise ValueError(f"the C step cannot run this model: {problem}")
        cfg = decoder.config
        self.decoder = decoder  # keeps every tensor the descriptors point into alive
        self.lib = library()
        self.vocab = cfg.vocab_size
        variants: list[tuple[float, float, int]] = []
        self.rope_variants: list[tuple[float, float, Tensor | None]] = []
        layers = []
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            key = (attn.rope_theta, attn.rope_scaling, id(attn.freq_factors) if attn.freq_factors is not None else 0)
            if key not in variants:
                variants.append(key)
                self.rope_variants.append((attn.rope_theta, attn.rope_scaling, attn.freq_factors))
            sandwich = cfg.sandwich_norms
            layers.append(LayerDesc(
                q=_matrix(attn.q_proj), k=_matrix(attn.k_proj), v=_matrix(attn.v_proj), o=_matrix(attn.o_proj),
                gate=_matrix(mlp.gate_proj), up=_matrix(mlp.up_proj), down=_matrix(mlp.down_proj),
                q_bias=_pointer(attn.q_proj.bias), k_bias=_pointer(attn.k_proj.bias),
                v_bias=_pointer(attn.v_proj.bias), o_bias=_pointer(attn.o_proj.bias),
                input_norm=_pointer(layer.input_layernorm.weight),
                post_attn_norm=_pointer(layer.post_attention_layernorm.weight),
                pre_ffn_norm=_pointer(layer.pre_feedforward_layernorm.weight) if sandwich else None,
                post_ffn_norm=_pointer(layer.post_feedforward_layernorm.weight) if sandwich else None,
                q_norm=_pointer(attn.q_norm.weight) if cfg.qk_norm else None,
                k_norm=_pointer(attn.k_norm.weight) if cfg.qk_norm else None,
                window=cfg.sliding_window if cfg.sliding_layers[i] and cfg.sliding_window else 0,
                rope=variants.index(key),
            ))
        if len(variants) > 2:
            raise ValueError("the C step takes at most two RoPE variants")
        self.layers = (LayerDesc * len(layers))(*layers)
        self.embed = _matrix(decoder.embed_tokens)
        head = decoder.embed_tokens if cfg.tie_word_embeddings else decoder.lm_head
        self.head = _matrix(head)
        self.model = ModelDesc(
            hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_layers,
            eps=cfg.rms_norm_eps, attn_scale=cfg.scale,
            # Rounded to float32 first, as the torch path does.
            embed_scale=float(torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)) if cfg.scale_embeddings else 0.0,
            logit_softcap=cfg.final_logit_softcap or 0.0, sandwich=int(cfg.sandwich_norms),
            activation=ACTIVATIONS[cfg.activation], final_norm=_pointer(decoder.norm.weight),
        )
        self.model.embed = ctypes.pointer(self.embed)
        self.model.head = ctypes.pointer(self.head)
        self.model.layer = self.layers
        # Each RoPE variant's inverse frequencies, as the torch path computes them; the C step
        # turns positions into angles itself.
        self.inv_freq = [rope_inverse_frequencies(cfg.head_dim, theta, factors) for theta, _, factors
                         in self.rope_variants]
        for i in range(2):
            variant = min(i, len(self.inv_freq) - 1)
            self.model.inv_freq[i] = self.inv_freq[variant].data_ptr()
            self.model.rope_scaling[i] = self.rope_variants[variant][1]

    def forward(self, input_ids: Tensor, batch: StepBatch, cache: list[LayerKV]) -> Tensor:
        """Logits [R, vocab] of the step's wanted rows (float32)."""
        layout = batch.layout
        tokens = input_ids.to(torch.int64).contiguous()
        if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.vocab:
            raise IndexError(f"token id out of range for a vocabulary of {self.vocab}")
        for desc, kv in zip(self.layers, cache, strict=True):
            if kv.keys.dtype != torch.float32 or not kv.keys.is_contiguous() or not kv.values.is_contiguous():
                raise ValueError("the C step needs a contiguous float32 KV cache")
            desc.keys, desc.values = kv.keys.data_ptr(), kv.values.data_ptr()
        logits = torch.empty(len(layout.logit_rows), self.vocab, dtype=torch.float32)
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (
            layout.positions, layout.write_slots, layout.slot_start, layout.slots, layout.logit_rows)]
        step = StepDesc(rows=len(layout.positions), tokens=tokens.data_ptr(), positions=arrays[0].ctypes.data,
                        write_slots=arrays[1].ctypes.data, slot_start=arrays[2].ctypes.data,
                        slots=arrays[3].ctypes.data, logit_rows_count=len(layout.logit_rows),
                        logit_rows=arrays[4].ctypes.data, logits=logits.data_ptr())
        if self.lib.llorch_decoder_forward(ctypes.addressof(self.model), ctypes.addressof(step),
                                           torch.get_num_threads()) != 0:
            raise MemoryError(f"the C step could not allocate its buffers for {step.rows} rows")
        return logits
