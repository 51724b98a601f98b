"""The weights the loader expects from a config are exactly the decoder's: names and shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llorch.models.config import ModelConfig
from llorch.models.decoder import Decoder
from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights.loader import LoadedModel

pytestmark = pytest.mark.cpu

SWITCHES = [{}, {"qk_norm": False, "sandwich_norms": False}, {"qkv_bias": True}, {"qkv_bias": True, "o_bias": True},
            {"tie_word_embeddings": False}, {"num_kv_heads": 4, "num_heads": 8}]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: ",".join(s) or "as-loaded")
def test_every_weight_the_decoder_takes_is_expected_with_its_shape(served: LoadedModel, switches: dict) -> None:
    config: ModelConfig = replace(served.config, num_layers=3, **switches)
    with torch.device("meta"):
        decoder = {name: tuple(p.shape) for name, p in Decoder(config).state_dict().items()}
    assert decoder_weight_shapes(config) == decoder
