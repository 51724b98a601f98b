"""The BERT-family encoder: bidirectional attention over whole texts, pooled into one vector or one score.

Many texts of different lengths run as one packed batch: the projections and the MLP see
every token of every text as one matrix (no padding), and only attention, which must not
look across texts, gathers each text's rows into a block padded to the longest text.

What a model pools and how (mean, cls, last; a dense layer, normalization; a classification
head for cross-encoder rerankers) is data in EncoderConfig, read from the model's own files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

POOLINGS = ("mean", "cls", "last", "rank")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # "bert"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    context_length: int  # the longest text the model reads (its trained length, at most its position table)
    type_vocab_size: int
    layer_norm_eps: float
    activation: str  # "gelu" (erf) | "gelu_tanh"
    pooling: str  # one of POOLINGS: "rank" scores a pair with the classification head
    normalize: bool = False  # unit length after pooling (and the dense layer)
    dense: tuple[int, int, str] | None = None  # a projection after pooling: (in, out, activation)
    num_labels: int = 0  # the classification head's outputs (rerankers: 1)
    score_activation: str = "identity"  # applied to a reranker's logit: "sigmoid" | "identity" | "tanh"
    matryoshka_dimensions: tuple[int, ...] = ()  # shorter lengths the model was trained to be cut to

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dimensions(self) -> int:
        """The length of an embedding (1 for a score)."""
        if self.pooling == "rank":
            return 1
        return self.dense[1] if self.dense is not None else self.hidden_size


ACTIVATIONS = {"tanh": torch.tanh, "identity": lambda x: x, "sigmoid": torch.sigmoid}


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: Tensor, batch: PackedBatch) -> Tensor:
        def heads(t: Tensor) -> Tensor:  # packed [T, H] -> padded [B, heads, L, d]
            return batch.pad(t).view(batch.size, batch.longest, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask)
        context = batch.unpad(context.transpose(1, 2).reshape(batch.size, batch.longest, -1))
        x = self.attention_norm(x + self.attention_out(context))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x), approximate=self.approximate)))


class PackedBatch:
    """Texts of different lengths as one packed row of tokens, and the gather that pads them for attention."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        self.size, self.longest = len(lengths), max(lengths)
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        self.starts = torch.tensor(starts, device=device)
        lens = torch.tensor(lengths, device=device)
        column = torch.arange(self.longest, device=device)
        valid = column[None, :] < lens[:, None]  # [B, L]
        self.valid = valid
        # Padded slot (b, j) reads packed row starts[b] + j; padding reads row 0 and is masked out.
        self.index = torch.where(valid, self.starts[:, None] + column[None, :], 0)
        self.mask = valid[:, None, None, :]  # keys a query may attend to: its own text's
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

    def pad(self, packed: Tensor) -> Tensor:
        return packed[self.index]

    def unpad(self, padded: Tensor) -> Tensor:
        return padded[self.valid]

    def mean(self, packed: Tensor) -> Tensor:
        sums = torch.zeros(self.size, packed.shape[-1], dtype=packed.dtype, device=packed.device)
        owner = torch.repeat_interleave(torch.arange(self.size, device=packed.device),
                                        torch.tensor(self.lengths, device=packed.device))
        sums.index_add_(0, owner, packed)
        return sums / torch.tensor(self.lengths, dtype=packed.dtype, device=packed.device)[:, None]


class Encoder(nn.Module):
    """Token, position and type embeddings, the layers, then pooling; `forward` gives one row per text."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(cfg.context_length, hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        if cfg.pooling == "rank":
            self.pooler = nn.Linear(hidden, hidden)
            self.classifier = nn.Linear(hidden, cfg.num_labels)
        if cfg.dense is not None:
            self.dense = nn.Linear(cfg.dense[0], cfg.dense[1])

    def forward(self, ids: Tensor, type_ids: Tensor, lengths: list[int]) -> Tensor:
        """Packed token ids and type ids of texts of `lengths` -> [texts, dimensions] (scores: [texts, 1])."""
        batch = PackedBatch(lengths, ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(batch.positions) + self.token_type_embeddings(type_ids)
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return self.pool(x, batch)

    def pool(self, x: Tensor, batch: PackedBatch) -> Tensor:
        cfg = self.config
        firsts = batch.starts
        if cfg.pooling == "rank":  # BERT's pooler on [CLS], the classifier, the model's own activation
            logits = self.classifier(torch.tanh(self.pooler(x[firsts])))
            return ACTIVATIONS[cfg.score_activation](logits[:, :1])
        if cfg.pooling == "mean":
            pooled = batch.mean(x)
        elif cfg.pooling == "cls":
            pooled = x[firsts]
        else:  # last
            pooled = x[firsts + torch.tensor(batch.lengths, device=x.device) - 1]
        if cfg.dense is not None:
            pooled = ACTIVATIONS[cfg.dense[2]](self.dense(pooled))
        if cfg.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=-1)
        return pooled
