"""PEFT adapters read into host memory for the worker's slots.

peft_format.py checks a folder (config and safetensors header, no torch); here its tensors
are read, B pre-scaled by its module's alpha / r (alpha / sqrt(r) with rsLoRA), so applying
an adapter is two matmuls. `AdapterCache` keeps the `max_cpu_loras` most recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from slotserve.lora.gguf_adapter import read_gguf_weights
from slotserve.lora.peft_format import AdapterChecker, module_shapes, read_adapter_spec
from slotserve.lora.request import LoRAAdapterError, LoRARequest
from slotserve.model_config import ModelConfig

# Re-exported: the front imports the checker from peft_format (no torch).
__all__ = ["AdapterCache", "AdapterChecker", "LoRAModel", "load_adapter", "module_shapes"]


@dataclass(slots=True)
class LoRAModel:
    """One adapter in host memory: (layer, module) -> (A [r, in], B scaled [out, r])."""

    lora_request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(req: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAModel:
    """Check the folder (peft_format.read_adapter_spec), then read its tensors."""
    spec = read_adapter_spec(req, cfg, max_rank)
    if spec.format == "gguf":
        arrays = read_gguf_weights(spec.weights_file, cfg,
                                   [(m.a_key, m.b_key) for m in spec.modules])
        weights = {(m.layer, m.module): (torch.from_numpy(a), torch.from_numpy(b) * m.scaling)
                   for m, (a, b) in zip(spec.modules, arrays, strict=True)}
        return LoRAModel(req, spec.rank, weights)
    try:
        tensors = load_file(str(spec.weights_file))
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): cannot "
                               f"read it: {exc}") from exc
    weights = {(m.layer, m.module): (tensors[m.a_key].float(),
                                     tensors[m.b_key].float() * m.scaling)
               for m in spec.modules}
    return LoRAModel(req, spec.rank, weights)


class AdapterCache:
    """Adapters read from disk, the `capacity` most recently used kept."""

    def __init__(self, cfg: ModelConfig, max_rank: int, capacity: int) -> None:
        self.cfg, self.max_rank, self.capacity = cfg, max_rank, capacity
        self._models: OrderedDict[int, LoRAModel] = OrderedDict()

    def get(self, req: LoRARequest) -> LoRAModel:
        model = self._models.get(req.lora_int_id)
        if model is not None and model.lora_request == req:
            self._models.move_to_end(req.lora_int_id)
            return model
        model = load_adapter(req, self.cfg, self.max_rank)
        self._models[req.lora_int_id] = model
        while len(self._models) > self.capacity:
            self._models.popitem(last=False)
        return model
