"""Which rotary embedding each layer uses, read from the config alone (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llorch.models.config import ModelConfig


@dataclass(frozen=True)
class RopeVariant:
    theta: float
    scaling: float  # divides the positions (linear scaling)
    factors: tuple[float, ...] | None  # divide each inverse frequency (Llama 3's long-context factors)


def layer_rope(config: ModelConfig, sliding: bool) -> RopeVariant:
    """A sliding-window layer of a model with a local theta (Gemma 3) rotates by it, unscaled; every
    other layer by the global theta, scaling and factors."""
    if sliding and config.rope_local_theta is not None:
        return RopeVariant(config.rope_local_theta, 1.0, None)
    return RopeVariant(config.rope_theta, config.rope_global_scaling, config.rope_freq_factors)


def inverse_frequencies(head_dim: int, variant: RopeVariant) -> np.ndarray:
    """theta^(-2i/head_dim) divided by the factors, computed in float64 and rounded once to float32.

    The torch decoder computes them in float32 as its references do; these differ from those by
    at most one unit in the last place.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inverse = 1.0 / variant.theta**exponents
    if variant.factors is not None:
        inverse = inverse / np.asarray(variant.factors, dtype=np.float64)
    return np.ascontiguousarray(inverse, dtype=np.float32)
