"""Native block-quantized matmul on the CPU: y = x @ W^T with W kept in a GGUF block format.

Two ways to multiply (`--quantization`):

* `auto` (int8 activations, llama.cpp's scheme): every row of x is quantized once per call
  to 8 bits with llama.cpp's rounding, Q8_K for the K-quants and Q8_0 / Q8_1 for the others
  (`ACT_KINDS`), and multiplied with integer dot products per block, then the block scales
  (`csrc/q8act.h`, `csrc/q8dot.h`; AVX-512 VNNI, AVX-VNNI, AVX2 or portable C, whatever the
  CPU level the library was built for has). Four times the multiply-adds per instruction of
  float32, and what llama.cpp's own numbers are.
* `exact` (float32 activations): `csrc/qmatmul.c` dequantizes tiles of the weight to exactly
  gguf's float32 values and multiplies them with float32 activations, so the result equals
  dequantize-then-matmul up to the order of the float32 sums; the torch path (`none`: the
  weight dequantized once, `F.linear`) stays the reference and the fallback.

Why kernels of our own (measured on this project's machine; README "Quantized weights"):
torch 2.13's CPU kernels for grouped low-bit weights either take float32 activations and run
at 1-3 GFLOP/s (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), or need bfloat16
activations and scales, and `_weight_int8pack_mm` has one scale per output channel only,
where Q8_0 / Q5_0 / Q6_K have one per 32 (or 16) values.

Types with a kernel: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (`KERNEL_TYPES`). The
library is built like the decode-attention kernel (`native_build`, one library per CPU level);
when it cannot be built, `qmatmul_available()` says no (logged once) and the loader
dequantizes instead.

`QuantWeight` checks a weight once and its calls' arguments every time, for real
(`NativeKernelError`, not asserts); the kernel checks the block layout, row ranges and row ids
again before reading. The int8 path is one native call per product (`QMatmulPlan`,
native_qmatmul_plan.py: quantize x and multiply every weight sharing it); `quantize` and
`matmul_quantized` are its two halves, kept as the reference it is tested against. Nothing is
allocated per call: the dequantization scratch and the quantized activations are per calling
thread and grow to the largest need seen.
"""

from __future__ import annotations

import threading

import torch

from slotserve.models.native_build import NativeKernelError, kernel_pool
from slotserve.models.native_qmatmul_plan import QMatmulPlan
from slotserve.models.qmatmul_lib import (
    ACT_KINDS,
    KERNEL,
    KERNEL_TYPES,
    QMatmulLib,
    _library,
    block_layout,
    cpu_has_avx512,
    kernel_error,
    kernel_isa,
    level_library,
    prefetch_policy,
    qmatmul_available,
)
from slotserve.models.weight_arena import weight_buffer

__all__ = ["ACT_KINDS", "KERNEL", "KERNEL_TYPES", "QMatmulLib", "QuantWeight", "_library",
           "block_layout", "cpu_has_avx512", "kernel_isa", "level_library",
           "prefetch_policy", "qmatmul_available"]


_NR = 4  # the kernel's register tile: weight rows per tile, the split granularity
_TILE_FLOATS = 48 * 1024  # the kernel uses at most this much scratch per thread (192 KiB)
# Below this many multiply-adds per call the Python pool's hand-off (tens of microseconds)
# costs more than it saves (`exact`; the int8 path's bar is native_qmatmul_plan's).
_PARALLEL_MIN_WORK = 1 << 22
_local = threading.local()


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(f"quantized matmul: {what}")


def _act_buffer(kind: int, nbytes: int) -> torch.Tensor:
    """This thread's buffer for quantized activations of one kind (a layer's q/k/v may need
    two kinds at once)."""
    bufs: dict[int, torch.Tensor] | None = getattr(_local, "acts", None)
    if bufs is None:
        bufs = _local.acts = {}
    buf = bufs.get(kind)
    if buf is None or buf.numel() < nbytes:
        buf = bufs[kind] = torch.empty(max(nbytes, 64 * 1024), dtype=torch.uint8)
    return buf


def _scratch(threads: int, k: int) -> torch.Tensor:
    """This thread's scratch: `threads` rows of at least a tile of k-value rows."""
    per = max(_TILE_FLOATS, _NR * k)
    buf: torch.Tensor | None = getattr(_local, "scratch", None)
    if buf is None or buf.shape[0] < threads or buf.shape[1] < per:
        rows = max(threads, buf.shape[0] if buf is not None else 0)
        cols = max(per, buf.shape[1] if buf is not None else 0)
        buf = torch.empty(rows, cols, dtype=torch.float32)
        _local.scratch = buf
    return buf


class QuantWeight:
    """A matrix [n, k] held as n rows of GGML type `qtype` blocks (`blocks`: uint8 [n, bytes
    per row], contiguous, on the CPU), checked once here; each call checks only its own
    arguments. `int8`: multiply with 8-bit activations (`auto`), else float32 (`exact`).
    `lib`: a level's kernel (level_library), default the one qmatmul_available() loaded.
    `packed`: `blocks` is in the kernel's interleaved layout (`repacked()`), not GGUF's."""

    __slots__ = ("_plan", "blocks", "int8", "k", "lib", "n", "packed", "qtype", "row_bytes")

    def __init__(self, blocks: torch.Tensor, qtype: int, k: int, int8: bool = True,
                 lib: QMatmulLib | None = None, packed: bool = False) -> None:
        self.lib = _library() if lib is None else lib
        block, size = self.lib.layout.get(qtype, (0, 0))
        _check(block > 0, f"GGML type {qtype} has no kernel")
        _check(blocks.dtype == torch.uint8 and blocks.device.type == "cpu"
               and blocks.dim() == 2 and blocks.is_contiguous(), "the weight must be a "
               "contiguous uint8 CPU tensor [rows, bytes per row]")
        _check(k > 0 and k % block == 0 and blocks.shape[1] == k // block * size,
               f"{KERNEL_TYPES[qtype]} rows of {k} values take {k // block * size} bytes, "
               f"the weight has {blocks.shape[1]}")
        self.blocks, self.qtype, self.k, self.int8 = blocks, qtype, k, int8
        self.n, self.row_bytes = blocks.shape
        self.packed = packed
        self._plan: QMatmulPlan | None = None
        _check(not packed or self.can_repack, f"a {self.n}-row {KERNEL_TYPES[qtype]} weight "
               "has no packed layout in this build")

    @property
    def can_repack(self) -> bool:
        """Whether the int8 path multiplies this weight faster interleaved
        (QMatmulLib.can_repack)."""
        return self.int8 and self.lib.can_repack(self.qtype, self.n)

    def repacked(self) -> QuantWeight:
        """This weight in the kernel's interleaved layout (a new buffer of the same size;
        self when it is packed already or has no such layout). The values multiplied are
        the same blocks; only the order of the float sums differs from the GGUF layout's."""
        if self.packed or not self.can_repack:
            return self
        # Streamed from DRAM every step: on huge pages (weight_arena.py).
        out = weight_buffer(self.blocks.numel() * self.blocks.element_size()
                            ).view(self.blocks.dtype).view(self.blocks.shape)
        rc = self.lib.repack(self.qtype, self.blocks.data_ptr(), self.n, self.k,
                             self.row_bytes, out.data_ptr(), out.numel())
        if rc != 0:
            raise kernel_error("repack", rc)
        return QuantWeight(out, self.qtype, self.k, self.int8, self.lib, packed=True)

    @property
    def act_kind(self) -> int:
        """The activation quantization the int8 path takes (ACT_KINDS)."""
        return self.lib.act_kind[self.qtype]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows quantized as this weight's int8 path takes them (a view of this thread's
        buffer, valid until the next call for the same kind): uint8 [m, row bytes]."""
        lib = self.lib
        kind, m, k = self.act_kind, x.shape[0], self.k
        _check(x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32
               and x.device.type == "cpu" and x.stride(1) == 1
               and (m <= 1 or x.stride(0) >= k), f"x must be float32 [rows, {k}] on the CPU "
               "with contiguous rows")
        rb = lib.act_row_bytes(kind, k)
        buf = _act_buffer(kind, m * rb)
        rc = lib.quantize(kind, x.data_ptr(), x.stride(0), m, k, buf.data_ptr(), buf.numel())
        if rc != 0:
            raise kernel_error("activation quantization", rc)
        return buf[:m * rb].view(m, rb)

    def plan(self) -> QMatmulPlan:
        """This weight alone as a one-call int8 product (made once, then reused)."""
        if self._plan is None:
            _check(self.int8, "a float32-activation weight has no int8 plan")
            self._plan = QMatmulPlan([(self, 0)], self.n)
        return self._plan

    def matmul_quantized(self, act: torch.Tensor, out: torch.Tensor, threads: int = 1) -> None:
        """out = x @ W^T from x's rows already quantized (`quantize`): the second half of the
        two-call path, kept as the reference the one-call plan is tested against."""
        lib = self.lib
        m = act.shape[0]
        _check(act.dtype == torch.uint8 and act.is_contiguous() and out.dtype == torch.float32
               and out.dim() == 2 and out.shape == (m, self.n) and out.stride(1) == 1,
               f"act must be quantized rows and out float32 [{m}, {self.n}]")
        if self.packed:
            rc = lib.q8_matmul_packed(self.qtype, self.blocks.data_ptr(), self.n, self.k,
                                      self.row_bytes, act.data_ptr(), act.numel(), m,
                                      out.data_ptr(), out.stride(0), threads)
        else:
            rc = lib.q8_matmul(self.qtype, self.blocks.data_ptr(), self.n, self.k,
                               self.row_bytes, act.data_ptr(), act.numel(), m, out.data_ptr(),
                               out.stride(0), 0, self.n, threads)
        if rc != 0:
            raise kernel_error("quantized matmul", rc)

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ W^T: x [m, k] float32, out [m, n] float32 (rows of either may be
        strided, e.g. out a column slice of a larger output; values contiguous)."""
        if self.int8:
            self.plan().run(x, out)
            return
        lib = self.lib
        n, k = self.n, self.k
        _check(x.dim() == 2 and out.dim() == 2, "x and out must be matrices")
        m = x.shape[0]
        _check(x.shape[1] == k and out.shape[0] == m and out.shape[1] == n,
               f"x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a [{n}, {k}] weight")
        _check(x.dtype == torch.float32 and out.dtype == torch.float32
               and x.device.type == "cpu" and out.device.type == "cpu",
               "x and out must be float32 CPU tensors")
        ldx, ldo = x.stride(0), out.stride(0)
        _check(x.stride(1) == 1 and out.stride(1) == 1 and (m <= 1 or (ldx >= k and ldo >= n)),
               "x and out must have contiguous rows")
        if m == 0 or n == 0:
            return
        threads = torch.get_num_threads()
        if threads > 1:  # small products are not worth the pool's hand-offs
            threads = (max(1, min(threads, n // (4 * _NR))) if m * n * k >= _PARALLEL_MIN_WORK
                       else 1)
        # float32 activations (`exact`): ranges of the Python pool, each with its scratch
        scratch = _scratch(threads, k)
        per = scratch.shape[1]
        args = (self.qtype, self.blocks.data_ptr(), n, k, self.row_bytes, x.data_ptr(), ldx,
                m, out.data_ptr(), ldo)

        def run(part: int, n0: int, n1: int) -> None:
            rc = lib.matmul(*args, n0, n1, scratch.data_ptr() + part * per * 4, per)
            if rc != 0:
                raise kernel_error("quantized matmul", rc)

        if threads <= 1:
            run(0, 0, n)
            return
        # Ranges of whole register tiles, one per thread (ctypes drops the GIL during a call).
        tiles = -(-n // _NR)
        bounds = [min(n, tiles * j // threads * _NR) for j in range(threads + 1)]
        list(kernel_pool(threads).map(run, range(threads), bounds[:-1], bounds[1:]))

    def rows(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = row ids[i] dequantized (an embedding lookup): ids int64 [r] contiguous,
        out [r, k] float32 with contiguous rows. A row id outside W raises, nothing written."""
        lib = self.lib
        _check(ids.dtype == torch.int64 and ids.device.type == "cpu" and ids.dim() == 1
               and ids.is_contiguous(), "ids must be a contiguous int64 CPU vector")
        _check(out.dtype == torch.float32 and out.device.type == "cpu" and out.dim() == 2
               and out.shape[0] == ids.shape[0] and out.shape[1] == self.k
               and out.stride(1) == 1,
               f"out must be float32 [{ids.shape[0]}, {self.k}] with contiguous rows")
        rows = lib.rows_packed if self.packed else lib.rows
        rc = rows(self.qtype, self.blocks.data_ptr(), self.n, self.k, self.row_bytes,
                  ids.data_ptr(), ids.shape[0], out.data_ptr(), out.stride(0))
        if rc != 0:
            raise kernel_error("quantized embedding", rc)
