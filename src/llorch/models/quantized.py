"""Quantized stand-ins for the decoder's Linear and Embedding layers.

The decoder is built with plain nn.Linear/nn.Embedding; the loader swaps in these
modules for the weights it keeps quantized (`swap_quantized`), before the state dict
is assigned. They hold int8 blocks (see llorch.kernels.q8) and compute in float32,
handing results back in the model's compute dtype.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn

from llorch.kernels import q8

SCALES_SUFFIX = "_scales"  # the state-dict key of a quantized weight's block scales: "<name>.weight_scales"


class Q8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight" + SCALES_SUFFIX, torch.empty(out_features, in_features // q8.QBLOCK))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = q8.matmul(x.reshape(-1, self.in_features), self.weight, self.weight_scales).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Q8Embedding(nn.Module):
    """The token embedding; when tied, also the vocabulary projection (`project`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("weight" + SCALES_SUFFIX, torch.empty(num_embeddings, embedding_dim // q8.QBLOCK))

    def forward(self, ids: Tensor) -> Tensor:
        # The kernel reads raw memory: an id out of range must fail here, as nn.Embedding would.
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
        return q8.gather_rows(self.weight, self.weight_scales, ids).to(self.dtype).view(*ids.shape, -1)

    def project(self, hidden: Tensor) -> Tensor:
        return q8.matmul(hidden, self.weight, self.weight_scales).to(hidden.dtype)


def swap_quantized(model: nn.Module, weights: Collection[str], dtype: torch.dtype) -> None:
    """Replace the Linear/Embedding owning each weight name in `weights` by its quantized twin."""
    for name in weights:
        module_name, _, leaf = name.rpartition(".")
        if leaf != "weight":
            raise ValueError(f"{name} is not a layer weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, attr)
        if isinstance(dense, nn.Linear):
            twin: nn.Module = Q8Linear(dense.in_features, dense.out_features, dense.bias is not None, dtype)
        elif isinstance(dense, nn.Embedding):
            twin = Q8Embedding(dense.num_embeddings, dense.embedding_dim, dtype)
        else:
            raise ValueError(f"{name} belongs to a {type(dense).__name__}, which has no quantized form")
        setattr(parent, attr, twin)
