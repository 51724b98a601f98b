"""Stand-ins for the decoder's Linear and Embedding layers that hold GGUF blocks as they are.

The decoder is built with plain nn.Linear/nn.Embedding; the loader swaps in these
modules for the weights it keeps in the file's own types (`swap_quantized`), before the
state dict is assigned. A weight is a uint8 tensor [rows, row_bytes] of the file's
blocks plus its GGUF type (`weight_type`, a 0-d int32 buffer so it travels with the
state dict). They compute in float32 through the block kernels (llorch.kernels.blocks);
the C decoder step reads the same tensors directly.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn

from llorch.kernels import blocks

TYPE_SUFFIX = "_type"  # the state-dict key of a block weight's GGUF type: "<name>.weight_type"


class GGUFLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.empty(out_features, 0, dtype=torch.uint8))
        self.register_buffer("weight" + TYPE_SUFFIX, torch.zeros((), dtype=torch.int32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @property
    def qtype(self) -> int:
        return int(self.weight_type)

    def forward(self, x: Tensor) -> Tensor:
        out = blocks.matmul(x.reshape(-1, self.in_features), self.weight, self.qtype).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class GGUFEmbedding(nn.Module):
    """The token embedding; when tied, also the vocabulary projection (`project`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, 0, dtype=torch.uint8))
        self.register_buffer("weight" + TYPE_SUFFIX, torch.zeros((), dtype=torch.int32))

    @property
    def qtype(self) -> int:
        return int(self.weight_type)

    def forward(self, ids: Tensor) -> Tensor:
        # The kernel reads raw memory: an id out of range must fail here, as nn.Embedding would.
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
        rows = blocks.dequantize_rows(self.weight, self.qtype, self.embedding_dim, ids.reshape(-1))
        return rows.to(self.dtype).view(*ids.shape, -1)

    def project(self, hidden: Tensor) -> Tensor:
        return blocks.matmul(hidden, self.weight, self.qtype).to(hidden.dtype)


def swap_quantized(model: nn.Module, weights: Collection[str], dtype: torch.dtype) -> None:
    """Replace the Linear/Embedding owning each weight name in `weights` by its GGUF-typed twin."""
    for name in weights:
        module_name, _, leaf = name.rpartition(".")
        if leaf != "weight":
            raise ValueError(f"{name} is not a layer weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, attr)
        if isinstance(dense, nn.Linear):
            twin: nn.Module = GGUFLinear(dense.in_features, dense.out_features, dense.bias is not None, dtype)
        elif isinstance(dense, nn.Embedding):
            twin = GGUFEmbedding(dense.num_embeddings, dense.embedding_dim, dtype)
        else:
            raise ValueError(f"{name} belongs to a {type(dense).__name__}, which has no GGUF-typed form")
        setattr(parent, attr, twin)
