"""The worker's table of `max_loras` adapter slots, applied to a whole batch at once.

`LoRASlots` wraps each projection of the decoder (qkv, o, gate_up, down) in a `LoRALinear`
that adds the LoRA delta of every token's adapter to the base output: the base weights stay
as they are (quantized or not), and a model without LoRA is never wrapped (zero cost).

Each wrapped layer holds every slot's weights in two fixed tensors padded to max_lora_rank R
(punica's layout): A [in, slots * shards * R] (slot-major: a slot's fused q/k/v or gate/up A
are adjacent columns, so one product shrinks all its shards) and, per shard, B [slots * R,
out]. The runner orders a step's requests by slot (within decodes and within prefills), so
each adapter's tokens are contiguous runs. Short runs (decodes, small chunks) go together
through a few batch-wide ops whatever the number of adapters (punica's bgmv): one shrink of
the rows against the A of the slot range they use, a one-hot mask keeping each row's own
slot, one expand per shard. A long run (a prefill chunk) shrinks and expands against its own
slot's views only (sgmv's segment), so it pays no other slot's flops. Base rows skip both.
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

    `dense`: (first row, end, first slot, slot count, mask [rows, slots, 1]) for the short
    runs before the first long one, or None; `runs`: (slot, first row, end) of the others."""

    __slots__ = ("dense", "runs")

    def __init__(self) -> None:
        self.dense: tuple[int, int, int, int, torch.Tensor] | None = None
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
            short = runs[:n_short]
            t0, t1 = short[0][1], short[-1][2]
            s0, s1 = min(s for s, _, _ in short), max(s for s, _, _ in short)
            onehot = token_slots[t0:t1, None] == np.arange(s0, s1 + 1)[None, :]
            mask = torch.from_numpy(onehot.astype(np.float32)).to(device, dtype)
            self.dense = (t0, t1, s0, s1 - s0 + 1, mask.unsqueeze(2))
            runs = runs[n_short:]
        self.runs = runs


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], cfg: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.layer, self.batch = base, layer, batch
        self.rank, n_shards = cfg.max_lora_rank, len(modules)
        self.modules_ = modules
        # (first output column, end) of each shard
        self.columns: list[tuple[int, int]] = []
        start = 0
        for name in modules:
            self.columns.append((start, start + shapes[name][1]))
            start += shapes[name][1]
        r = self.rank
        self.lora_a = torch.zeros(shapes[modules[0]][0], cfg.max_loras * n_shards * r,
                                  dtype=dtype, device=device)
        self.lora_b = [torch.zeros(cfg.max_loras * r, shapes[name][1], dtype=dtype,
                                   device=device) for name in modules]
        # Slots whose adapter targets this layer (the others add nothing).
        self.targeted = [False] * cfg.max_loras

    def set_slot(self, slot: int, model: LoRAModel | None) -> None:
        r, n_shards = self.rank, len(self.modules_)
        a_slot = self.lora_a[:, slot * n_shards * r:(slot + 1) * n_shards * r]
        a_slot.zero_()
        self.targeted[slot] = False
        for k, name in enumerate(self.modules_):
            b_slot = self.lora_b[k][slot * r:(slot + 1) * r]
            b_slot.zero_()
            ab = model.weights.get((self.layer, name)) if model is not None else None
            if ab is not None:
                a, b = ab  # [rank, in], [out, rank]; zero-padded to R
                self.targeted[slot] = True
                a_slot[:, k * r:k * r + a.shape[0]].copy_(a.t())
                b_slot[:b.shape[1]].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        r, n_shards = self.rank, len(self.modules_)
        dense = self.batch.dense
        if dense is not None:
            t0, t1, s0, n, mask = dense
            w = n_shards * r
            xa = x[t0:t1] @ self.lora_a[:, s0 * w:(s0 + n) * w]
            if n_shards == 1:
                xm = xa.view(t1 - t0, n, r).mul_(mask).view(t1 - t0, n * r)
                y[t0:t1].addmm_(xm, self.lora_b[0][s0 * r:(s0 + n) * r])
            else:
                # [rows, slots, shards, R] -> [shards, rows, slots * R]: one tiny copy, then
                # each shard's expand reads contiguous rows.
                xm = (xa.view(t1 - t0, n, n_shards, r) * mask.unsqueeze(2)).permute(2, 0, 1, 3)
                xm = xm.reshape(n_shards, t1 - t0, n * r)
                for k, (c0, c1) in enumerate(self.columns):
                    y[t0:t1, c0:c1].addmm_(xm[k], self.lora_b[k][s0 * r:(s0 + n) * r])
        for slot, t0, t1 in self.batch.runs:
            if not self.targeted[slot]:
                continue
            w = n_shards * r
            xa = x[t0:t1] @ self.lora_a[:, slot * w:(slot + 1) * w]
            for k, (c0, c1) in enumerate(self.columns):
                y[t0:t1, c0:c1].addmm_(xa[:, k * r:(k + 1) * r],
                                       self.lora_b[k][slot * r:(slot + 1) * r])
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
