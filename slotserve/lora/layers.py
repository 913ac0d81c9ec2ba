"""The worker's table of `max_loras` adapter slots, applied to a whole batch at once.

`LoRASlots` wraps each projection of the decoder (qkv, o, gate_up, down) in a `LoRALinear`
that adds the LoRA delta of every token's adapter to the base output: the base weights stay
as they are (quantized or not), and a model without LoRA is never wrapped (zero cost).

Each wrapped layer holds every slot's weights in fixed tensors padded to max_lora_rank R
(punica's layout): A [slots, in, shards * R] (a slot's fused q/k/v or gate/up A side by side,
so one product shrinks all its shards) and B [slots, shards * R, out], block-diagonal by
shard. The runner orders a step's requests by slot (within decodes and within prefills), so
each adapter's tokens are contiguous runs. Short runs (decodes, small chunks) go together
through four ops whatever the number of adapters (punica's bgmv): gather the rows by slot,
one batched shrink and one batched expand against the slots in use, one index_add back. A
long run (a prefill chunk) shrinks and expands against its own slot only (sgmv's segment).
Base rows skip both.
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

# A run of at least this many tokens of one adapter is applied on its own: below it the
# batch-wide ops (the slot range's flops on every row) cost less than a run's own ops.
LONG_RUN = 48


class LoRABatch:
    """This step's tokens by adapter slot, set once per step for every layer.

    `dense`: the short runs before the first long one, gathered by slot: (row index [slots *
    rows], valid [slots, rows, 1] or None when no slot's group is padded, the slots (first,
    count) when consecutive or their index tensor); `runs`: (slot, first row, end) of the
    others."""

    __slots__ = ("dense", "runs")

    def __init__(self) -> None:
        self.dense: tuple[torch.Tensor, torch.Tensor | None,
                          tuple[int, int] | torch.Tensor] | None = None
        self.runs: list[tuple[int, int, int]] = []

    def set_tokens(self, token_slots: np.ndarray, device: torch.device,
                   dtype: torch.dtype) -> None:
        """token_slots[t]: the adapter slot of token t of the step (-1: the base model), in
        runs (the runner sorts requests by slot)."""
        edges = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate(([0], edges)).tolist()
        ends = np.concatenate((edges, [len(token_slots)])).tolist()
        slots = token_slots[starts].tolist()
        runs = [(s, a, b) for s, a, b in zip(slots, starts, ends, strict=True) if s >= 0]
        # The short runs up to the first long one go batch-wide (decodes come first).
        n_short = 0
        while n_short < len(runs) and runs[n_short][2] - runs[n_short][1] < LONG_RUN:
            n_short += 1
        self.dense = None
        if n_short > 1:
            by_slot: dict[int, list[int]] = {}
            for s, a, b in runs[:n_short]:
                by_slot.setdefault(s, []).extend(range(a, b))
            used = sorted(by_slot)
            width = max(len(rows) for rows in by_slot.values())
            index = np.zeros((len(used), width), dtype=np.int64)
            valid = np.zeros((len(used), width, 1), dtype=np.float32)
            for i, s in enumerate(used):
                index[i, :len(by_slot[s])] = by_slot[s]
                valid[i, :len(by_slot[s])] = 1.0
            pick: tuple[int, int] | torch.Tensor = (
                (used[0], len(used)) if used[-1] - used[0] == len(used) - 1
                else torch.tensor(used, device=device))
            self.dense = (torch.from_numpy(index.reshape(-1)).to(device),
                          None if valid.all() else torch.from_numpy(valid).to(device, dtype),
                          pick)
            runs = runs[n_short:]
        self.runs = runs


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], cfg: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.layer, self.batch = base, layer, batch
        self.rank, self.modules_ = cfg.max_lora_rank, modules
        # (first output column, end) of each shard
        self.columns: list[tuple[int, int]] = []
        start = 0
        for name in modules:
            self.columns.append((start, start + shapes[name][1]))
            start += shapes[name][1]
        r = self.rank
        # A [slots, in, shards * R]; B [slots, shards * R, out], block-diagonal by shard.
        self.lora_a = torch.zeros(cfg.max_loras, shapes[modules[0]][0], len(modules) * r,
                                  dtype=dtype, device=device)
        self.lora_b = torch.zeros(cfg.max_loras, len(modules) * r, start, dtype=dtype,
                                  device=device)
        # Slots whose adapter targets this layer (the others add nothing).
        self.targeted = [False] * cfg.max_loras

    def set_slot(self, slot: int, model: LoRAModel | None) -> None:
        r = self.rank
        a_slot, b_slot = self.lora_a[slot], self.lora_b[slot]
        a_slot.zero_()
        b_slot.zero_()
        self.targeted[slot] = False
        for k, (name, (c0, c1)) in enumerate(zip(self.modules_, self.columns, strict=True)):
            ab = model.weights.get((self.layer, name)) if model is not None else None
            if ab is not None:
                a, b = ab  # [rank, in], [out, rank]; zero-padded to R
                self.targeted[slot] = True
                a_slot[:, k * r:k * r + a.shape[0]].copy_(a.t())
                b_slot[k * r:k * r + b.shape[1], c0:c1].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        dense = self.batch.dense
        if dense is not None:
            index, valid, pick = dense
            if isinstance(pick, tuple):
                a, b = self.lora_a[pick[0]:pick[0] + pick[1]], self.lora_b[pick[0]:pick[0] + pick[1]]
            else:
                a, b = self.lora_a.index_select(0, pick), self.lora_b.index_select(0, pick)
            xg = x.index_select(0, index).view(a.shape[0], -1, x.shape[1])
            if valid is not None:  # padding rows contribute nothing
                xg = xg * valid
            delta = torch.bmm(torch.bmm(xg, a), b)
            y.index_add_(0, index, delta.view(-1, y.shape[1]))
        for slot, t0, t1 in self.batch.runs:
            if self.targeted[slot]:
                y[t0:t1].addmm_(x[t0:t1] @ self.lora_a[slot], self.lora_b[slot])
        return y


class LoRASlots:
    """The wrapped layers of one model, and the token grouping of the step under way."""

    def __init__(self, model: DecoderForCausalLM, model_config: ModelConfig, cfg: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
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
        self.batch.set_tokens(token_slots, self.device, self.dtype)
