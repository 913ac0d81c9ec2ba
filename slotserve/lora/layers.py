"""The worker's table of `max_loras` adapter slots, applied to a whole batch at once.

`attach_lora` wraps each projection of the decoder (qkv, o, gate_up, down) in a `LoRALinear`
that adds the LoRA delta of every token's adapter to the base output: the base weights stay
as they are (quantized or not), and a model without LoRA is never wrapped (zero cost). Each
wrapped layer holds its slots' A and B stacked ([slots, shards * rank, in], [slots, out,
shards * rank]; a fused layer's B is block-diagonal over its shards, so q/k/v or gate/up stay
one matmul each). A step groups its tokens by slot (at most max_loras groups, as punica's
sgmv does per segment): one gather, two matmuls and one scatter-add per adapter in the batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slotserve.lora.adapters import AdapterCache, LoRAModel, module_shapes
from slotserve.lora.request import LoRAConfig, LoRARequest
from slotserve.model_config import ModelConfig
from slotserve.models.layers import DecoderForCausalLM

# wrapped attribute -> (owner attribute, the checkpoint modules fused into it, in order)
_WRAPPED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("self_attn", "o_proj", ("o_proj",)),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
            ("mlp", "down_proj", ("down_proj",)))


class LoRABatch:
    """This step's tokens by adapter slot: (slot, token rows or None for every token)."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], cfg: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.layer, self.batch = base, layer, batch
        self.rank = cfg.max_lora_rank
        n_in = shapes[modules[0]][0]
        # (checkpoint module, first output row, rows)
        self.shards: list[tuple[str, int, int]] = []
        start = 0
        for name in modules:
            self.shards.append((name, start, shapes[name][1]))
            start += shapes[name][1]
        width = self.rank * len(modules)
        self.lora_a = torch.zeros(cfg.max_loras, width, n_in, dtype=dtype, device=device)
        self.lora_b = torch.zeros(cfg.max_loras, start, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, model: LoRAModel | None) -> None:
        a_all, b_all = self.lora_a[slot], self.lora_b[slot]
        a_all.zero_()
        b_all.zero_()
        if model is None:
            return
        for k, (name, start, rows) in enumerate(self.shards):
            ab = model.weights.get((self.layer, name))
            if ab is not None:
                a, b = ab
                col = k * self.rank
                a_all[col:col + a.shape[0]].copy_(a)
                b_all[start:start + rows, col:col + a.shape[0]].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for slot, rows in self.batch.groups:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if rows is None:
                y.add_((x @ a.t()) @ b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y


class LoRASlots:
    """The wrapped layers of one model, and the token grouping of the step under way."""

    def __init__(self, model: DecoderForCausalLM, model_config: ModelConfig, cfg: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.batch = LoRABatch()
        self.layers: list[LoRALinear] = []
        shapes = module_shapes(model_config)
        for i, decoder_layer in enumerate(model.model.layers):
            for owner_name, attr, modules in _WRAPPED:
                owner = getattr(decoder_layer, owner_name)
                wrapped = LoRALinear(getattr(owner, attr), i, modules, shapes, cfg,
                                     self.batch, dtype, device)
                setattr(owner, attr, wrapped)
                self.layers.append(wrapped)
        self.cache = AdapterCache(model_config, cfg.max_lora_rank, cfg.cpu_capacity)

    def load(self, slot: int, lora: LoRARequest) -> None:
        """Put an adapter into a slot (read from disk unless the host cache has it)."""
        model = self.cache.get(lora)
        for layer in self.layers:
            layer.set_slot(slot, model)

    def set_tokens(self, token_slots: np.ndarray) -> None:
        """token_slots[t]: the adapter slot of token t of the step (-1: the base model)."""
        groups: list[tuple[int, torch.Tensor | None]] = []
        used = np.unique(token_slots)
        if len(used) == 1 and used[0] >= 0:
            groups.append((int(used[0]), None))
        elif len(used) > 1:
            for s in used[used >= 0].tolist():
                rows = np.nonzero(token_slots == s)[0]
                groups.append((s, torch.from_numpy(rows).to(self.device)))
        self.batch.groups = groups
