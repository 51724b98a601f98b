"""The BERT-family encoder: bidirectional attention over whole texts, pooled into one vector or one score.

Many texts of different lengths run as one packed batch: the projections and the MLP see
every token of every text as one matrix (no padding); attention, which must not look
across texts, runs text by text on views of those rows.

What a model pools and how (mean, cls, last; a dense layer, normalization; a classification
head for cross-encoder rerankers) is data in EncoderConfig, read from the model's own files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llorch.models.encoder_config import EncoderConfig

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
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1) if hasattr(self, "qkv") else (
            self.query(x), self.key(x), self.value(x))
        context = torch.empty_like(q)
        scale = self.head_dim**-0.5
        # Attention text by text on views of the packed rows: no padding and no gather, and each text's scores
        # are its own length squared (a padded batch computes the longest text's for every text).
        for start, length in zip(batch.starts_list, batch.lengths, strict=True):
            rows = slice(start, start + length)
            qh, kh, vh = (t[rows].view(length, self.heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
            probs = torch.softmax(torch.matmul(qh, kh.transpose(1, 2)).mul_(scale), dim=-1)
            context[rows].view(length, self.heads, self.head_dim).copy_(torch.matmul(probs, vh).transpose(0, 1))
        x = self.attention_norm(x + self.attention_out(context))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x), approximate=self.approximate)))

    def fuse_projections(self) -> None:
        """q, k and v as one matrix (one product of the packed rows instead of three), every matrix stored
        transposed for the plain product (InputMajorLinear)."""
        with torch.no_grad():
            self.qkv = InputMajorLinear(torch.cat([self.query.weight, self.key.weight, self.value.weight]),
                                        torch.cat([self.query.bias, self.key.bias, self.value.bias]))
        del self.query, self.key, self.value
        for name in ("attention_out", "intermediate", "output"):
            linear = getattr(self, name)
            setattr(self, name, InputMajorLinear(linear.weight, linear.bias))


class InputMajorLinear(nn.Module):
    """A Linear whose weight is kept transposed, [in, out] and contiguous, so that x @ W^T is a plain product.

    CPU BLAS runs that form faster for the few rows of one text (2 threads: 23% less time per layer at 30
    rows, 13% at 55) and no slower for thousands of rows (measured): a text alone is an encoder's latency."""

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x, self.weight_t)


class PackedBatch:
    """Texts of different lengths as one packed row of tokens: where each starts, and its positions."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        self.size = len(lengths)
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        self.starts_list = starts
        self.starts = torch.tensor(starts, device=device)
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

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

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.fuse_projections()  # type: ignore[operator]

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
