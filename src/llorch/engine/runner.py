"""The model runner: KV cache allocation and forward passes on the worker's device.

Every tensor it creates lives on the worker's device, and the residency guard
checks the caches it hands out; the only values that leave the device are the
sampled token ids (in the engine).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from llorch.device import assert_module_resident, assert_resident, tensor_bytes
from llorch.models.decoder import Decoder, LayerKV


class ModelRunner:
    def __init__(self, model: Decoder, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        assert_module_resident(device, model)
        self.weight_bytes = tensor_bytes([*model.parameters(), *model.buffers()])
        self._kv_bytes = 0
        self._lock = threading.Lock()  # kv accounting is read from the HTTP thread

    @property
    def kv_bytes(self) -> int:
        with self._lock:
            return self._kv_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes the model and its KV caches hold on the device (the contract's vram_bytes)."""
        return self.weight_bytes + self.kv_bytes

    def allocate_cache(self, capacity: int) -> list[LayerKV]:
        cfg = self.config
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        cache = [
            LayerKV(torch.empty(shape, dtype=self.dtype, device=self.device),
                    torch.empty(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        assert_resident(self.device, self._named(cache))
        with self._lock:
            self._kv_bytes += self.cache_bytes(cache)
        return cache

    def free_cache(self, cache: list[LayerKV]) -> None:
        with self._lock:
            self._kv_bytes -= self.cache_bytes(cache)
        for layer in cache:  # drop the storage now, not when the sequence object goes away
            layer.keys = layer.values = torch.empty(0, device=self.device)

    @staticmethod
    def cache_bytes(cache: list[LayerKV]) -> int:
        return tensor_bytes(t for layer in cache for t in (layer.keys, layer.values))

    @staticmethod
    def _named(cache: list[LayerKV]) -> list[tuple[str, Tensor]]:
        return [item for i, layer in enumerate(cache)
                for item in ((f"kv.{i}.keys", layer.keys), (f"kv.{i}.values", layer.values))]

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, start: int, cache: list[LayerKV]) -> Tensor:
        """Last-position logits [vocab] after feeding `token_ids` (1-d, on the device) at `start`."""
        positions = torch.arange(start, start + token_ids.numel(), device=self.device)
        return self.model(token_ids.view(1, -1), positions, cache)[0, -1]
