"""PEFT adapter folders read into host memory, checked against the base model.

A folder holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in]
and `lora_B.weight` [out, r]. B is stored pre-scaled (alpha / r, or alpha / sqrt(r) for
rsLoRA), so applying an adapter is two matmuls. `AdapterCache` keeps the `max_cpu_loras`
most recently used adapters read.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from slotserve.lora.request import LoRAAdapterError, LoRARequest
from slotserve.model_config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every module an adapter may target."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass(slots=True)
class LoRAModel:
    """One adapter in host memory: (layer, module) -> (A [r, in], B scaled [out, r])."""

    lora_request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(req: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAModel:
    name = req.lora_name
    folder = Path(req.lora_path).expanduser()

    def fail(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r} ({folder}): {why}")

    try:
        meta = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read it: {exc}") from exc
    if not isinstance(meta, dict):
        raise fail("adapter_config.json is not an object")
    rank, alpha = meta.get("r"), meta.get("lora_alpha", meta.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise fail("adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank={max_rank}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if meta.get(key):
            raise fail(f"{key} is not supported")
    if meta.get("bias", "none") != "none" or meta.get("fan_in_fan_out"):
        raise fail("adapters with bias or fan_in_fan_out are not supported")
    scaling = alpha / (math.sqrt(rank) if meta.get("use_rslora") else rank)
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise fail(f"unexpected tensor {key!r}")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise fail(f"targets {module!r}, which the model lacks (it has "
                       f"{', '.join(TARGET_MODULES)})")
        if layer >= cfg.num_hidden_layers:
            raise fail(f"targets layer {layer}; the model has {cfg.num_hidden_layers}")
        halves.setdefault((layer, module), {})[half] = t
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(halves.items()):
        n_in, n_out = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        where = f"layer {layer} {module}"
        if a is None or b is None:
            raise fail(f"{where} lacks lora_{'A' if a is None else 'B'}")
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise fail(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the "
                       f"base ({n_out} x {n_in}) at rank {rank}")
        weights[(layer, module)] = (a.float(), b.float() * scaling)
    if not weights:
        raise fail("it holds no LoRA weights")
    return LoRAModel(req, rank, weights)


class AdapterChecker:
    """The front's check of a request's adapter: read once per adapter, and one id never
    names two adapters (the engine keys slots and prefix-cache hashes by the id)."""

    def __init__(self, cfg: ModelConfig, max_rank: int) -> None:
        self.cfg, self.max_rank = cfg, max_rank
        self.checked: dict[int, LoRARequest] = {}

    def __call__(self, req: LoRARequest) -> None:
        known = self.checked.get(req.lora_int_id)
        if known == req:
            return
        if known is not None:
            raise LoRAAdapterError(f"lora_int_id {req.lora_int_id} already names adapter "
                                   f"{known.lora_name!r} ({known.lora_path})")
        load_adapter(req, self.cfg, self.max_rank)
        self.checked[req.lora_int_id] = req


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
