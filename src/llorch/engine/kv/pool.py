"""The KV pool's memory: every layer's keys and values, allocated once on the worker's device.

The pool is cut into blocks of BLOCK_SIZE token slots; blocks.py decides which
sequence uses which. Block 0 (NULL_BLOCK) is kept zeroed: padded attention reads it,
so it must hold finite numbers.

On the device None the pool is host numpy arrays of float16, which the C step reads without
torch (kernels/csrc/attention.c says why float16).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

import numpy as np

from llorch.engine.kv.blocks import NULL_BLOCK
from llorch.models.config import ModelConfig
from llorch.models.step_layout import LayerKV

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16  # tokens per KV block: the unit of allocation and of prefix sharing
HOST_KV_DTYPE = np.dtype(np.float16)  # the C step's keys and values


def host_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """HOST_KV_DTYPE zeros on anonymous 4 KB pages, resident only once touched. numpy itself asks for
    huge pages above 4 MB, and then the first touch of each block would make 2 MB resident."""
    count = int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(count * HOST_KV_DTYPE.itemsize, 1)), dtype=HOST_KV_DTYPE,
                         count=count).reshape(shape)


def allocate_kv(config: ModelConfig, slots: int, dtype: Any, device: torch.device | None,
                zeroed: bool = False) -> list[LayerKV]:
    """Keys and values of `slots` token slots for every layer: [slots, kv_heads, head_dim] each; for the
    device None, zeroed host arrays of HOST_KV_DTYPE (whatever `dtype`) [kv_heads, slots, head_dim], the C
    step's layout (kernels/csrc/attention.c says why)."""
    shape = (slots, config.num_kv_heads, config.head_dim)
    if device is None:
        host = (config.num_kv_heads, slots, config.head_dim)
        return [LayerKV(host_zeros(host), host_zeros(host)) for _ in range(config.num_layers)]
    import torch

    make = torch.zeros if zeroed else torch.empty  # empty: untouched pages cost no RSS
    return [LayerKV(make(shape, dtype=dtype, device=device), make(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]


def bytes_per_block(config: ModelConfig, dtype: Any, block_size: int = BLOCK_SIZE) -> int:
    """`dtype` is a torch or numpy dtype: both say their item size."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize * block_size


class KVPool:
    """`num_blocks` blocks of `block_size` slots for every layer, on `device`."""

    def __init__(self, config: ModelConfig, device: torch.device | None, dtype: Any, budget_bytes: int,
                 block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.block_bytes = bytes_per_block(config, HOST_KV_DTYPE if device is None else dtype, block_size)
        self.num_blocks = budget_bytes // self.block_bytes
        if self.num_blocks < 2:
            raise ValueError("the KV cache budget is smaller than two blocks")
        self.layers = allocate_kv(config, self.num_blocks * block_size, dtype, device)
        if device is not None:  # host arrays start zeroed
            from llorch.device import assert_resident

            null = slice(NULL_BLOCK * block_size, (NULL_BLOCK + 1) * block_size)
            for layer in self.layers:
                layer.keys[null].zero_()
                layer.values[null].zero_()
            assert_resident(device, [item for i, layer in enumerate(self.layers) for item in
                                     ((f"kv.{i}.keys", layer.keys), (f"kv.{i}.values", layer.values))])
        self.bytes = sum(t.nbytes for layer in self.layers for t in (layer.keys, layer.values))

    @property
    def tokens(self) -> int:
        """Tokens the pool can hold at once (the padding block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def pad_slot(self) -> int:
        return NULL_BLOCK * self.block_size
