"""The batched LoRA computation (lora/layers.py) equals each row's own adapter applied alone,
for steps mixing base rows, short runs (batch-wide ops over a slot range) and long runs (a
run's own slot), adapters of smaller ranks than the slots and adapters skipping a shard; on
the torch path and through the native kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from slotserve.lora import layers
from slotserve.lora.adapters import LoRAModel
from slotserve.lora.layers import LoRABatch, LoRALinear
from slotserve.lora.native_bgmv import native_bgmv_supported
from slotserve.lora.request import LoRAConfig, LoRARequest

SHAPES = {"q_proj": (24, 32), "k_proj": (24, 8), "v_proj": (24, 8), "o_proj": (32, 24)}


def random_model(slot: int, rank: int, modules: tuple[str, ...]) -> LoRAModel:
    g = torch.Generator().manual_seed(slot)
    weights = {(0, m): (torch.randn(rank, SHAPES[m][0], generator=g),
                        torch.randn(SHAPES[m][1], rank, generator=g)) for m in modules}
    return LoRAModel(LoRARequest(f"a{slot}", slot + 1, "/x"), rank, weights)


@pytest.mark.parametrize(("slots", "dense"), [
    ([-1, -1, 0, 0, 1, 2, 2, 2, 3] + [1] * 7 + [0] * 3 + [-1] * 2 + [3] * 9, True),
    ([0] * 9 + [2] * 5, False),
    ([-1] * 4 + [1] * 3, False),
    ([3, 3, 1] + [-1] * 10, True),
], ids=["mixed", "long-first", "one-run", "after-base"])
@pytest.mark.parametrize("modules", [("q_proj", "k_proj", "v_proj"), ("o_proj",)],
                         ids=["fused", "single"])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_bgmv_supported(torch.float32, torch.device("cpu")),
    reason="the native LoRA kernel does not build here"))], ids=["torch", "native"])
def test_batched_delta_equals_per_row(monkeypatch: pytest.MonkeyPatch, slots: list[int],
                                      dense: bool, modules: tuple[str, ...],
                                      native: bool) -> None:
    monkeypatch.setattr(layers, "LONG_RUN", 6)  # runs of 6+ rows take the per-run path
    n_in = SHAPES[modules[0]][0]
    n_out = sum(SHAPES[m][1] for m in modules)
    base = nn.Linear(n_in, n_out, bias=False)
    batch = LoRABatch()
    cfg = LoRAConfig(max_loras=4, max_lora_rank=8)
    lin = LoRALinear(base, 0, modules, SHAPES, cfg, batch, torch.float32, torch.device("cpu"),
                     native)
    # Slot 1: rank 4 on every shard; slot 2 skips the first shard; slot 3 is reloaded.
    models = [random_model(0, 8, modules), random_model(1, 4, modules),
              random_model(2, 8, modules[1:] or modules), random_model(9, 2, modules)]
    for slot, model in enumerate(models):
        lin.set_slot(slot, random_model(7, 8, modules))
        lin.set_slot(slot, model)
    x = torch.randn(len(slots), n_in)
    batch.set_tokens(np.array(slots), torch.device("cpu"), torch.float32)
    assert (batch.dense is not None) == dense
    with torch.no_grad():
        got = lin(x)
        want = base(x)
        col = dict(zip(modules, np.cumsum([0] + [SHAPES[m][1] for m in modules]).tolist(),
                       strict=False))
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            for (_, m), (a, b) in models[slot].weights.items():
                want[t, col[m]:col[m] + SHAPES[m][1]] += b @ (a @ x[t])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
