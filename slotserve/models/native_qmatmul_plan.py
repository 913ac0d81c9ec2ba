"""One native call per int8 matmul (`--quantization auto`): `QMatmulPlan`.

The weights that multiply the same x (a layer's q/k/v, held as one buffer per run of same-type
shards; its fused gate/up; the output projection) become one `slotserve_qmatmul_q8_x` call
(csrc/q8call.h) that quantizes x's rows into this thread's scratch and multiplies every weight
into its columns of the output. Everything about the weights (their pointers, shapes, types,
layout, the scratch bytes a row needs, the multiply-adds a row costs) is worked out once here,
so a call checks and passes only x, the output, the scratch and the thread count: measured
on Gemma 3 270M's decode step it was ~21 us of Python and ctypes per product when quantizing
and multiplying were two calls with their arguments rebuilt each time.

The result is bit for bit that of the two-call path (`QuantWeight.quantize` then
`QuantWeight.matmul_quantized`, per weight): the same quantizer and kernels.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from slotserve.models.native_build import NativeKernelError
from slotserve.models.qmatmul_lib import (
    MAX_WEIGHTS_PER_CALL,
    PARALLEL_MIN_WORK,
    QmmSeg,
    kernel_error,
)

if TYPE_CHECKING:
    from slotserve.models.native_qmatmul import QuantWeight

_local = threading.local()
_F32 = torch.float32


def _scratch(nbytes: int) -> tuple[int, int]:
    """(address, size) of this thread's scratch for quantized rows, grown to `nbytes`."""
    cached: tuple[torch.Tensor, int, int] | None = getattr(_local, "q8x", None)
    if cached is None or cached[2] < nbytes:
        buf = torch.empty(max(nbytes, 64 * 1024), dtype=torch.uint8)
        cached = _local.q8x = (buf, buf.data_ptr(), buf.numel())
    return cached[1], cached[2]


class QMatmulPlan:
    """out[:, col:col + w.n] = x @ w^T for every (w, col) of `weights` (int8 QuantWeights of
    one library and one k), in one native call. `columns`: the output's width."""

    __slots__ = ("_addr", "_fn", "_nseg", "_row_scratch", "_segs", "_work", "columns", "k",
                 "weights")

    def __init__(self, weights: Sequence[tuple[QuantWeight, int]], columns: int) -> None:
        if not 1 <= len(weights) <= MAX_WEIGHTS_PER_CALL:
            raise NativeKernelError(f"quantized matmul: 1 to {MAX_WEIGHTS_PER_CALL} weights "
                                    f"per call, not {len(weights)}")
        first = weights[0][0]
        lib, k = first.lib, first.k
        for w, col in weights:
            if not (w.int8 and w.lib is lib and w.k == k and 0 <= col <= columns - w.n):
                raise NativeKernelError("quantized matmul: the weights of one call must be "
                                        "int8, of one library and one k, and fit the output")
        self.weights = [w for w, _ in weights]  # keeps their blocks alive
        self.k, self.columns = k, columns
        self._segs = (QmmSeg * len(weights))(*(
            QmmSeg(w.blocks.data_ptr(), w.n, w.row_bytes, col, w.qtype, int(w.packed))
            for w, col in weights))
        self._addr = ctypes.addressof(self._segs)
        self._nseg = len(weights)
        self._fn = lib.q8_x
        self._row_scratch = lib.q8_x_scratch(self._addr, self._nseg, k, 1)
        if self._row_scratch < 0:
            raise NativeKernelError("quantized matmul: a weight has no int8 kernel")
        self._work = k * sum(w.n for w in self.weights)  # multiply-adds per row of x

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x [m, k] float32, out [m, columns] float32, rows of either strided, values
        contiguous."""
        # Read once and compared by identity: these checks ran at ~2 us a call spelled
        # plainly (`x.device.type` alone builds a device object), on ~80 calls a step.
        xs, os_, xst, ost = x.shape, out.shape, x.stride(), out.stride()
        if not (x.dtype is _F32 and out.dtype is _F32 and x.is_cpu and out.is_cpu
                and len(xs) == 2 and len(os_) == 2 and xs[1] == self.k and os_[0] == xs[0]
                and os_[1] == self.columns and xst[1] == 1 and ost[1] == 1):
            raise NativeKernelError(
                f"quantized matmul: x {tuple(xs)} {x.dtype} and out {tuple(os_)} "
                f"{out.dtype} must be float32 [rows, {self.k}] and [rows, {self.columns}] CPU "
                "tensors with contiguous rows")
        m = xs[0]
        threads = torch.get_num_threads()
        if threads > 1 and m * self._work < PARALLEL_MIN_WORK:
            threads = 1
        addr, size = _scratch(m * self._row_scratch)
        rc = self._fn(self._addr, self._nseg, self.k, x.data_ptr(), xst[0], m, out.data_ptr(),
                      ost[0], addr, size, threads)
        if rc != 0:
            raise kernel_error("quantized matmul", rc)
