"""The native batched LoRA kernel (lora/native_bgmv.py) against the torch reference: every
row's y += B @ (A @ x) at its own adapter's rank (1..max), slots mixed in runs of every block
size, base rows untouched, shards an adapter skips, shapes off the kernel's vector widths;
built for every CPU level this machine runs (AVX-512, AVX2, portable C)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from slotserve.lora import native_bgmv
from slotserve.lora.native_bgmv import NativeLoRAWeights, native_bgmv_supported
from slotserve.models import native_build
from slotserve.models.native_attention import NativeKernelError

pytestmark = pytest.mark.skipif(
    not native_bgmv_supported(torch.float32, torch.device("cpu")),
    reason="the native LoRA kernel does not build here")


def reference(x: torch.Tensor, y: torch.Tensor, slot_of: list[int], cols: list[int],
              weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    for t, s in enumerate(slot_of):
        for k in range(len(cols) - 1):
            ab = weights.get((s, k))
            if s >= 0 and ab is not None:
                a, b = ab
                y[t, cols[k]:cols[k + 1]] += (b.double() @ (a.double() @ x[t].double())).float()


@pytest.mark.parametrize(("n_in", "widths", "max_rank"), [
    (37, [5, 70, 129], 7),      # scalar tails, 16-column tails and a 64-column tile
    (64, [64], 16),             # exact vector widths, one shard
    (576, [576, 192, 192], 16),  # SmolLM-135M's fused q/k/v
    (16, [1, 3], 1),            # rank 1, tiny outputs
], ids=["odd", "exact", "qkv135m", "rank1"])
def test_kernel_matches_reference(n_in: int, widths: list[int], max_rank: int) -> None:
    check_kernel(n_in, widths, max_rank)


@pytest.mark.parametrize("level", native_build.supported_levels(), ids=lambda lv: lv.name)
def test_every_cpu_level_matches_reference(tmp_path: Path, level: native_build.CpuLevel
                                           ) -> None:
    cc = native_build.find_compiler()
    assert cc is not None  # the module is skipped without a built kernel
    lib = native_build.compile_library(native_bgmv.KERNEL, cc, tmp_path, level)
    kernel = native_bgmv.bind(ctypes.CDLL(str(lib)))
    check_kernel(37, [5, 70, 129], 7, kernel)
    check_kernel(40, [33], 20, kernel)  # ranks past one vector of 16 lanes


def check_kernel(n_in: int, widths: list[int], max_rank: int,
                 kernel: Callable[..., int] | None = None) -> None:
    g = torch.Generator().manual_seed(n_in)
    n_slots = 4
    w = NativeLoRAWeights(n_slots, n_in, widths, max_rank, kernel)
    cols = np.concatenate(([0], np.cumsum(widths))).tolist()
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for s in range(n_slots):
        for k, width in enumerate(widths):
            if s == 2 and k == 0 and len(widths) > 1:  # slot 2 skips the first shard
                w.set_shard(s, k, None, None)
                continue
            r = 1 + (s * 5 + k * 3) % max_rank  # ranks 1..max, different per shard
            a = torch.randn(r, n_in, generator=g)
            b = torch.randn(width, r, generator=g)
            # A stale, larger adapter first: the new rank must be the only one read.
            w.set_shard(s, k, torch.randn(max_rank, n_in, generator=g),
                        torch.randn(width, max_rank, generator=g))
            w.set_shard(s, k, a, b)
            weights[(s, k)] = (a, b)
    # Runs of 1..6 rows (blocks of 4 and their remainders), base rows between and around.
    slot_of = [-1, 0, 1, 1, 2, 2, 2, -1, 3, 3, 3, 3, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, -1, -1, 2]
    x_full = torch.randn(len(slot_of), n_in + 3, generator=g)
    x = x_full[:, 1:n_in + 1]  # rows with a stride other than their length
    y = torch.randn(len(slot_of), cols[-1], generator=g)
    want = y.clone()
    reference(x, want, slot_of, cols, weights)
    w.apply(y, x, np.array(slot_of, dtype=np.int64))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    base_rows = [t for t, s in enumerate(slot_of) if s < 0]
    assert torch.equal(y[base_rows], want[base_rows])  # untouched, bit for bit


def test_no_adapter_rows_and_bad_slots() -> None:
    w = NativeLoRAWeights(2, 8, [8], 4)
    w.set_shard(0, 0, torch.ones(4, 8), torch.ones(8, 4))
    x, y = torch.ones(3, 8), torch.zeros(3, 8)
    w.apply(y, x, np.full(3, -1, dtype=np.int64))
    assert not y.any()
    w.apply(y, x, np.array([-1, 1, 0], dtype=np.int64))  # slot 1 holds nothing
    assert not y[:2].any() and torch.equal(y[2], torch.full((8,), 32.0))
    with pytest.raises(NativeKernelError, match="row 1 has adapter slot 2"):
        w.apply(y, x, np.array([0, 2, 0], dtype=np.int64))
    with pytest.raises(NativeKernelError, match="contiguous rows"):
        w.apply(y, x.t().contiguous().t(), np.zeros(3, dtype=np.int64))
    with pytest.raises(NativeKernelError, match="do not fit"):
        w.set_shard(1, 0, torch.ones(5, 8), torch.ones(8, 5))
