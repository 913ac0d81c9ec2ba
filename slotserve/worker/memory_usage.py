"""What a model runner holds in memory: weights (quantized blocks included) and its KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.models.quantization import weight_memory


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """What the runner holds: weights (quantized blocks included) and the KV cache, in bytes."""

    weights_bytes: int
    quantized_weights_bytes: int
    kv_cache_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
           ) -> MemoryUsage:
        quantized, dense = weight_memory(model)
        kv = sum(t.numel() * t.element_size() for pair in kv_caches for t in pair)
        return cls(quantized + dense, quantized, kv)
