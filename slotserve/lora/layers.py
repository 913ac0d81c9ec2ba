"""The worker's table of `max_loras` adapter slots, applied to a whole batch at once.

`LoRASlots` wraps each projection of the decoder (qkv, o, gate_up, down) in a `LoRALinear`
that adds the LoRA delta of every token's adapter to the base output: the base weights stay
as they are (quantized or not), and a model without LoRA is never wrapped (zero cost). Each
wrapped layer holds its slots' A and B stacked ([slots, shards * rank, in], [slots, out,
rank]): a fused layer (q/k/v, gate/up) runs one A product for all its shards, then one B
product per shard into its output columns. The runner orders a step's requests by slot, so
each adapter's tokens are contiguous runs (as punica's sgmv takes segments): per adapter in
the batch, two small matmuls on row slices, no gather or scatter.
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
    """This step's tokens by adapter slot: (slot, first token, end) runs; the runner orders
    requests by slot (within decodes and within prefills), so each adapter's tokens are at
    most two runs and a layer adds its delta to row slices, with no gather or scatter."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[int, int, int]] = []


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], cfg: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.layer, self.batch = base, layer, batch
        n_in = shapes[modules[0]][0]
        # (checkpoint module, first output row, rows)
        self.shards: list[tuple[str, int, int]] = []
        start = 0
        for name in modules:
            self.shards.append((name, start, shapes[name][1]))
            start += shapes[name][1]
        # Per slot: A of the shards stacked at the adapter's own rank r ([shards * r, in]
        # used), B of each shard in its output rows ([out, r] used); r = 0: not targeted.
        self.lora_a = torch.zeros(cfg.max_loras, len(modules) * cfg.max_lora_rank, n_in,
                                  dtype=dtype, device=device)
        self.lora_b = torch.zeros(cfg.max_loras, start, cfg.max_lora_rank, dtype=dtype,
                                  device=device)
        # Per slot, for the step: A^T [in, shards * r] and each shard's (columns, B^T), views
        # made once when the slot is loaded; None: the adapter does not target this layer.
        self.views: list[tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]] | None] = (
            [None] * cfg.max_loras)

    def set_slot(self, slot: int, model: LoRAModel | None) -> None:
        a_all, b_all = self.lora_a[slot], self.lora_b[slot]
        a_all.zero_()
        b_all.zero_()
        r = model.rank if model is not None else 0
        targeted = False
        for k, (name, start, rows) in enumerate(self.shards):
            ab = model.weights.get((self.layer, name)) if model is not None else None
            if ab is not None:
                targeted = True
                a_all[k * r:(k + 1) * r].copy_(ab[0])
                b_all[start:start + rows, :r].copy_(ab[1])
        self.views[slot] = None if not targeted else (
            a_all[:len(self.shards) * r].t(),
            [(start, start + rows, b_all[start:start + rows, :r].t())
             for _, start, rows in self.shards])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for slot, t0, t1 in self.batch.groups:
            views = self.views[slot]
            if views is None:
                continue
            a_t, shards = views
            xa = x[t0:t1] @ a_t
            if len(shards) == 1:
                y[t0:t1].addmm_(xa, shards[0][2])
                continue
            r = xa.shape[1] // len(shards)
            for k, (c0, c1, b_t) in enumerate(shards):
                y[t0:t1, c0:c1].addmm_(xa[:, k * r:(k + 1) * r], b_t)
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
        """token_slots[t]: the adapter slot of token t of the step (-1: the base model), in
        runs (the runner sorts requests by slot)."""
        edges = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate(([0], edges)).tolist()
        ends = np.concatenate((edges, [len(token_slots)])).tolist()
        slots = token_slots[starts].tolist()
        self.batch.groups = [(s, a, b) for s, a, b in zip(slots, starts, ends, strict=True)
                             if s >= 0]
