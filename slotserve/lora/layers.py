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

For float32 on the CPU the native kernel (lora/native_bgmv.py) replaces all of that: one
call per projection applies every row at its own adapter's rank (no padding to R), the
shards of a fused projection sharing the read of x; the torch ops above stay the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slotserve.lora.adapters import AdapterCache, LoRAModel, module_shapes
from slotserve.lora.native_bgmv import NativeLoRAWeights, native_bgmv_supported
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
    others. `slot_of`: every token's slot, for the native kernel (which needs nothing
    else; `torch_path` False skips building the torch path's grouping); `any_lora`: whether
    any token has an adapter."""

    __slots__ = ("any_lora", "dense", "runs", "slot_of", "slot_ptr", "torch_path")

    def __init__(self, torch_path: bool = True) -> None:
        self.dense: tuple[torch.Tensor, torch.Tensor | None,
                          tuple[int, int] | torch.Tensor] | None = None
        self.runs: list[tuple[int, int, int]] = []
        self.slot_of = np.zeros(0, dtype=np.int64)
        self.slot_ptr = self.slot_of.ctypes.data  # its address, taken once per step
        self.any_lora = False
        self.torch_path = torch_path

    def set_tokens(self, token_slots: np.ndarray, device: torch.device,
                   dtype: torch.dtype) -> None:
        """token_slots[t]: the adapter slot of token t of the step (-1: the base model), in
        runs (the runner sorts requests by slot)."""
        self.slot_of = np.ascontiguousarray(token_slots, dtype=np.int64)
        self.slot_ptr = self.slot_of.ctypes.data
        self.any_lora = bool(len(token_slots)) and int(token_slots.max()) >= 0
        if not self.torch_path:
            return
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
    """A base projection plus every slot's LoRA on its shards; `native`: through the native
    kernel (float32 CPU only), else the torch ops."""

    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], cfg: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
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
        n_in = shapes[modules[0]][0]
        self.native = (NativeLoRAWeights(cfg.max_loras, n_in, [shapes[m][1] for m in modules],
                                         r) if native else None)
        # Torch path: A [slots, in, shards * R]; B [slots, shards * R, out], block-diagonal
        # by shard (empty on the native path).
        shape_a, shape_b = ((cfg.max_loras, n_in, len(modules) * r),
                            (cfg.max_loras, len(modules) * r, start)) if not native else (
                                (0, 0, 0), (0, 0, 0))
        self.lora_a = torch.zeros(shape_a, dtype=dtype, device=device)
        self.lora_b = torch.zeros(shape_b, dtype=dtype, device=device)
        # Slots whose adapter targets this layer (the others add nothing).
        self.targeted = [False] * cfg.max_loras

    def set_slot(self, slot: int, model: LoRAModel | None) -> None:
        r = self.rank
        self.targeted[slot] = False
        if self.native is None:
            a_slot, b_slot = self.lora_a[slot], self.lora_b[slot]
            a_slot.zero_()
            b_slot.zero_()
        for k, (name, (c0, c1)) in enumerate(zip(self.modules_, self.columns, strict=True)):
            ab = model.weights.get((self.layer, name)) if model is not None else None
            self.targeted[slot] |= ab is not None
            if self.native is not None:
                self.native.set_shard(slot, k, *(ab or (None, None)))
            elif ab is not None:
                a, b = ab  # [rank, in], [out, rank]; zero-padded to R
                a_slot[:, k * r:k * r + a.shape[0]].copy_(a.t())
                b_slot[k * r:k * r + b.shape[1], c0:c1].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        if self.native is not None:
            if self.batch.any_lora:
                self.native.apply(y, x, self.batch.slot_of, self.batch.slot_ptr)
            return y
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
                 dtype: torch.dtype, device: torch.device, native: bool = True) -> None:
        """`native`: the native kernel where it builds for this dtype and device."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        native = native and native_bgmv_supported(dtype, device)
        self.batch = LoRABatch(torch_path=not native)
        self.layers: list[LoRALinear] = []
        shapes = module_shapes(model_config)
        for i, decoder_layer in enumerate(model.model.layers):
            for owner_name, attr, modules in _WRAPPED:
                owner = getattr(decoder_layer, owner_name)
                wrapped = LoRALinear(getattr(owner, attr), i, modules, shapes, cfg,
                                     self.batch, dtype, device, native)
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
