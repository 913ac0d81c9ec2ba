"""The native batched LoRA kernel (`models/csrc/lora_bgmv.c`) for float32 on the CPU.

`NativeLoRAWeights` holds one wrapped projection's slots in the kernel's layout (A
transposed, [slots, shards, in, R rounded up to 16 lanes]; B transposed and packed per
shard, [slots, R * out]; each slot's rank per shard) and applies them to a step's rows in one
call: shrink then expand for every row at its own adapter's rank, base rows skipped. The torch path (lora/layers.py) stays the reference
and the fallback where the kernel does not build.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np
import torch

from slotserve.models import native_build
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_build import CSRC, KernelSource

# The instruction set comes from the CPU level (native_build.CPU_LEVELS).
KERNEL = KernelSource("lora_bgmv", CSRC / "lora_bgmv.c",
                      ("-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"))

_P, _I = ctypes.c_void_p, ctypes.c_int64
_F32 = torch.float32


@functools.cache
def _kernel() -> Callable[..., int] | None:
    """The kernel built for this CPU, or None (the build failure logged once)."""
    dll = native_build.load_kernel(KERNEL, "LoRA runs on the torch path")
    return bind(dll) if dll is not None else None


def native_bgmv_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel applies LoRA here (building it on first call; where it does not
    build, the layers keep the torch path)."""
    return dtype == _F32 and device.type == "cpu" and _kernel() is not None


def bind(dll: ctypes.CDLL) -> Callable[..., int]:
    """The kernel's entry point in a loaded build, its argument types declared."""
    f = dll.slotserve_lora_bgmv
    f.argtypes = [_P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I]
    f.restype = ctypes.c_int64
    return f  # type: ignore[no-any-return]  # a ctypes function


class NativeLoRAWeights:
    """One wrapped projection's adapter slots in the kernel's layout."""

    def __init__(self, n_slots: int, n_in: int, widths: list[int], max_rank: int,
                 kernel: Callable[..., int] | None = None) -> None:
        """`kernel`: another build's entry point (bind()), else this CPU's."""
        kernel = kernel or _kernel()
        if kernel is None:
            raise NativeKernelError("lora_bgmv: the kernel is not available")
        self._call = kernel
        self.n_slots, self.n_in, self.rank = n_slots, n_in, max_rank
        self.shards = len(widths)
        self.cols = np.concatenate(([0], np.cumsum(widths))).astype(np.int64)
        self.out = int(self.cols[-1])
        self.a = torch.zeros(n_slots, self.shards, n_in, -(-max_rank // 16) * 16)
        self.bt = torch.zeros(n_slots, max_rank * self.out)
        self.ranks = np.zeros((n_slots, self.shards), dtype=np.int32)
        # The buffers never move (slots are filled in place): their addresses are taken once.
        self._ptrs = (self.a.data_ptr(), self.bt.data_ptr(), self.ranks.ctypes.data,
                      self.cols.ctypes.data)

    def set_shard(self, slot: int, shard: int, a: torch.Tensor | None,
                  b: torch.Tensor | None) -> None:
        """Slot `slot`'s adapter on shard `shard`: A [r, in], B (scaled) [out_k, r]; None:
        the adapter does not target it."""
        if a is None or b is None:
            self.ranks[slot, shard] = 0
            return
        r = a.shape[0]
        c0, c1 = int(self.cols[shard]), int(self.cols[shard + 1])
        if r > self.rank or a.shape[1] != self.n_in or b.shape != (c1 - c0, r):
            raise NativeKernelError(f"lora_bgmv: A {tuple(a.shape)} / B {tuple(b.shape)} do "
                                    f"not fit shard {shard} ({c1 - c0} x {self.n_in}, rank "
                                    f"<= {self.rank})")
        self.a[slot, shard].zero_()  # the lanes past r are computed: they must be zeros
        self.a[slot, shard, :, :r].copy_(a.t())
        self.bt[slot, self.rank * c0:self.rank * c0 + r * (c1 - c0)].view(r, c1 - c0).copy_(
            b.t())
        self.ranks[slot, shard] = r

    def apply(self, y: torch.Tensor, x: torch.Tensor, slot_of: np.ndarray,
              slot_ptr: int | None = None) -> None:
        """y[t] += this projection's LoRA delta of row t under adapter slot slot_of[t] (-1:
        none), for every row at once. x [n, in] and y [n, out] float32 CPU with contiguous
        rows; slot_of a contiguous int64 array of n, `slot_ptr` its address when the caller
        has it (numpy takes microseconds to give it: a step takes it once for every layer)."""
        n = x.shape[0]
        xs, ys = x.stride(), y.stride()
        if (x.dtype != _F32 or y.dtype != _F32 or not x.is_cpu or not y.is_cpu
                or x.dim() != 2 or y.dim() != 2 or x.shape[1] != self.n_in
                or y.shape != (n, self.out) or xs[1] != 1 or ys[1] != 1
                or slot_of.shape != (n,) or slot_of.dtype != np.int64
                or not slot_of.flags.c_contiguous):
            raise NativeKernelError(
                f"lora_bgmv: x {x.dtype} {tuple(x.shape)} strides {x.stride()}, y {y.dtype} "
                f"{tuple(y.shape)} strides {y.stride()}, slots {slot_of.dtype} "
                f"{slot_of.shape}: float32 CPU [n, {self.n_in}] / [n, {self.out}] with "
                f"contiguous rows and int64 [n] expected")
        if slot_ptr is None:
            slot_ptr = slot_of.ctypes.data
        a, bt, ranks, cols = self._ptrs
        bad = self._call(x.data_ptr(), xs[0], y.data_ptr(), ys[0], n, slot_ptr, a, bt, ranks,
                         cols, self.shards, self.rank, self.n_in, self.n_slots)
        if bad:
            raise NativeKernelError(f"lora_bgmv: row {bad - 1} has adapter slot "
                                    f"{int(slot_of[bad - 1])}; there are {self.n_slots}")
