"""An encoder's shapes and poolings, apart from its torch modules (models/encoder.py), so that
what only reads them (flags, the APIs' model descriptions) costs no torch import."""

from __future__ import annotations

from dataclasses import dataclass

POOLINGS = ("mean", "cls", "last", "rank")
ENCODER_ARCHITECTURES = ("bert",)  # a GGUF file of these holds an encoder


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
