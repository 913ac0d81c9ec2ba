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

import ctypes
import os
import threading
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

from slotserve.errors import ConfigError
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_build import (
    CSRC,
    CpuLevel,
    KernelSource,
    cpu_level,
    cpu_vendor,
    kernel_pool,
    load_kernel,
    supported_levels,
)
from slotserve.models.native_qmatmul_plan import QMatmulPlan, kernel_error
from slotserve.models.weight_arena import weight_buffer

KERNEL = KernelSource(
    "qmatmul", CSRC / "qmatmul.c",
    # No contraction of the dequantizers' multiply-then-add: their values must be gguf's.
    # The instruction set comes from the CPU level (native_build.CPU_LEVELS).
    ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
     "-pthread"),
    # The one-call int8 path shares its rows with helper threads of its own (csrc/q8pool.h);
    # the two-call reference path splits over an OpenMP team (libgomp.so.1: the one torch
    # loaded already), and a compiler without OpenMP builds that single-threaded.
    link_variants=(("-fopenmp",), ()))

# GGML type id -> name, for the types the kernel runs (gguf's enum of ggml.h's ggml_type).
KERNEL_TYPES: dict[int, str] = {int(q): q.name for q in (
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
# The activation quantization each type's integer dot product takes (q8act.h's enum).
ACT_KINDS: dict[int, str] = {0: "Q8_0", 1: "Q8_1", 2: "Q8_K"}
_NR = 4  # the kernel's register tile: weight rows per tile, the split granularity
_TILE_FLOATS = 48 * 1024  # the kernel uses at most this much scratch per thread (192 KiB)
# Below this many multiply-adds per call the Python pool's hand-off (tens of microseconds)
# costs more than it saves (`exact`; the int8 path's bar is native_qmatmul_plan's).
_PARALLEL_MIN_WORK = 1 << 22


class _Lib:
    def __init__(self, dll: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.matmul: Callable[..., int] = dll.slotserve_qmatmul_f32
        self.matmul.argtypes = [ctypes.c_int32, p, i, i, i, p, i, i, p, i, i, i, p, i]
        self.matmul.restype = ctypes.c_int
        self.rows: Callable[..., int] = dll.slotserve_dequant_rows_f32
        self.rows.argtypes = [ctypes.c_int32, p, i, i, i, p, i, p, i]
        self.rows.restype = ctypes.c_int
        self.q8_matmul: Callable[..., int] = dll.slotserve_qmatmul_q8
        self.q8_matmul.argtypes = [ctypes.c_int32, p, i, i, i, p, i, i, p, i, i, i,
                                   ctypes.c_int32]
        self.q8_matmul.restype = ctypes.c_int
        self.quantize: Callable[..., int] = dll.slotserve_q8_quantize
        self.quantize.argtypes = [ctypes.c_int32, p, i, i, i, p, i]
        self.quantize.restype = ctypes.c_int
        self.act_row_bytes: Callable[..., int] = dll.slotserve_q8_act_row_bytes
        self.act_row_bytes.argtypes = [ctypes.c_int32, i]
        self.act_row_bytes.restype = ctypes.c_int64
        self.repack: Callable[..., int] = dll.slotserve_q8_repack
        self.repack.argtypes = [ctypes.c_int32, p, i, i, i, p, i]
        self.repack.restype = ctypes.c_int
        self.rows_packed: Callable[..., int] = dll.slotserve_dequant_rows_packed
        self.rows_packed.argtypes = [ctypes.c_int32, p, i, i, i, p, i, p, i]
        self.rows_packed.restype = ctypes.c_int
        self.q8_matmul_packed: Callable[..., int] = dll.slotserve_qmatmul_q8_packed
        self.q8_matmul_packed.argtypes = [ctypes.c_int32, p, i, i, i, p, i, i, p, i,
                                          ctypes.c_int32]
        self.q8_matmul_packed.restype = ctypes.c_int
        self.q8_x: Callable[..., int] = dll.slotserve_qmatmul_q8_x
        self.q8_x.argtypes = [p, ctypes.c_int32, i, p, i, i, p, i, p, i, ctypes.c_int32]
        self.q8_x.restype = ctypes.c_int
        # A pure decode step's layers in one call (q8layers.h, native_layers.py).
        self.decode_layers: Callable[..., int] = dll.slotserve_decode_layers
        self.decode_layers.argtypes = [p, p, i, p]
        self.decode_layers.restype = ctypes.c_int
        self.q8_x_scratch: Callable[..., int] = dll.slotserve_q8x_scratch_bytes
        self.q8_x_scratch.argtypes = [p, ctypes.c_int32, i, i]
        self.q8_x_scratch.restype = ctypes.c_int64
        repack_rows = dll.slotserve_q8_repack_rows
        repack_rows.argtypes = [ctypes.c_int32]
        repack_rows.restype = ctypes.c_int32
        # Rows per interleaved group where this build multiplies the type repacked (0: never).
        self.repack_rows: dict[int, int] = {qtype: repack_rows(qtype) for qtype in KERNEL_TYPES}
        act_kind = dll.slotserve_q8_act_kind
        act_kind.argtypes = [ctypes.c_int32]
        act_kind.restype = ctypes.c_int32
        isa = dll.slotserve_q8_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()
        self.act_kind: dict[int, int] = {qtype: act_kind(qtype) for qtype in KERNEL_TYPES}
        # How far ahead, and from how many activation rows, the kernels prefetch (per CPU).
        self.set_prefetch: Callable[[int, int, int, int], None] = dll.slotserve_set_prefetch
        self.set_prefetch.argtypes = [ctypes.c_int64] * 4
        self.set_prefetch.restype = None
        self.set_prefetch(*prefetch_policy())
        layout = dll.slotserve_qtype_layout
        layout.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                           ctypes.POINTER(ctypes.c_int32)]
        self.layout: dict[int, tuple[int, int]] = {}
        for qtype in KERNEL_TYPES:
            block, size = ctypes.c_int32(), ctypes.c_int32()
            layout(qtype, ctypes.byref(block), ctypes.byref(size))
            self.layout[qtype] = (block.value, size.value)


_PREFETCH_ENV = "SLOTSERVE_PREFETCH"
# CPU vendors whose hardware prefetcher streams a light type's weight (Q4_0 / Q5_0 / Q8_0)
# faster without software prefetches at one to three activation rows (AMD Zen 4, the 262k x
# 640 Q8_0 output projection: 6.0 ms without against 8.8 ms with them 4 KiB ahead at one row,
# 46.6 with against 50.6 ms without at 32); the K-quants prefetch at any row count, and
# elsewhere (Intel) every type does, as the kernels were tuned.
_FEW_PREFETCH_VENDORS = frozenset({"AuthenticAMD", "HygonGenuine"})
# On those, a packed Q4_K tile's weight bytes are asked for 16 KiB ahead into L2, not 4 KiB
# into L1 (csrc/qmatmul.c: slotserve_set_prefetch says why; Gemma's 640 x 1024 Q4_K read cold
# at one row: 25 -> 15 us on the AMD EPYC). Intel keeps what its kernels were tuned with.
_Q4K_L2_BYTES = 16384
# On AMD without AVX-512 (Zen 3 and older, which run the AVX2 kernels), AVX2's int16 Q8_0
# path asks for the output projection's bytes 2 KiB ahead at one to three rows, where Zen 4
# and Intel read it faster without (csrc/qmatmul.c: q8_i16_few).
_I16_FEW_BYTES_AVX2_AMD = 2048


def cpu_has_avx512() -> bool:
    """Whether this CPU runs AVX-512 (whatever level $SLOTSERVE_CPU_LEVEL forces)."""
    return supported_levels()[0].name.startswith("v4")


def prefetch_policy() -> tuple[int, int, int, int]:
    """(bytes ahead, from how many activation rows a light type's call does, bytes ahead a
    packed Q4_K tile asks for into L2 instead (0: as the others), bytes ahead AVX2's int16
    Q8_0 path asks below 4 rows (0: none)) the int8 kernels prefetch streamed weights with on
    this CPU; `SLOTSERVE_PREFETCH=BYTES[,ROWS[,Q4K_L2_BYTES[,Q8_FEW_ROWS_BYTES]]]` overrides
    it (0: never; benchmarks compare them)."""
    forced = os.environ.get(_PREFETCH_ENV)
    if forced:
        try:
            parts = [int(v) for v in forced.split(",")]
            if len(parts) > 4 or min(parts) < 0:
                raise ValueError(forced)
        except ValueError:
            raise ConfigError(f"{_PREFETCH_ENV}={forced!r}: expected BYTES, BYTES,ROWS, "
                              "BYTES,ROWS,Q4K_L2_BYTES or BYTES,ROWS,Q4K_L2_BYTES,"
                              "Q8_FEW_ROWS_BYTES (non-negative integers)") from None
        v = parts + [1, 0, 0][len(parts) - 1:]  # the fields left out: 1 row, 0, 0
        return v[0], v[1], v[2], v[3]
    if cpu_vendor() in _FEW_PREFETCH_VENDORS:
        return 4096, 4, _Q4K_L2_BYTES, 0 if cpu_has_avx512() else _I16_FEW_BYTES_AVX2_AMD
    return 4096, 1, 0, 0


# None: not tried yet; False: unavailable (already logged); else the loaded library.
_lib: _Lib | bool | None = None
_level_libs: dict[str, _Lib | None] = {}
_lock = threading.Lock()
_local = threading.local()


def qmatmul_available() -> bool:
    """Whether the kernel builds and loads here (building it on the first call)."""
    global _lib
    with _lock:
        if _lib is None:
            dll = load_kernel(KERNEL, "quantized weights are dequantized at load")
            _lib = _Lib(dll) if dll is not None else False
    return _lib is not False


def level_library(level: CpuLevel) -> _Lib | None:
    """The kernel built for one CPU level (tests and benchmarks compare levels); None when
    it does not build (logged)."""
    with _lock:
        if level.name not in _level_libs:
            dll = load_kernel(KERNEL, f"level {level.name}", level)
            _level_libs[level.name] = _Lib(dll) if dll is not None else None
        return _level_libs[level.name]


def _library() -> _Lib:
    if not isinstance(_lib, _Lib):
        raise NativeKernelError("quantized matmul: called before qmatmul_available() built "
                                "the kernel")
    return _lib


def kernel_isa() -> str:
    """The integer dot products' instructions in the loaded kernel, e.g. "avx512-vnni"."""
    return f"{_library().isa} ({cpu_level().name})"


def block_layout(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a kernel type, as the kernel itself has it."""
    layout = _library().layout.get(qtype)
    if layout is None or layout[0] == 0:
        raise NativeKernelError(f"quantized matmul: GGML type {qtype} has no kernel")
    return layout


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
                 lib: _Lib | None = None, packed: bool = False) -> None:
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
        """Whether this build multiplies the weight faster in its interleaved layout
        (csrc/q8repack.h: Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K, in groups of 16 rows with AVX-512
        VNNI, of 8 with AVX2; the rows a multiple of the group)."""
        rows = self.lib.repack_rows[self.qtype]
        return self.int8 and rows > 0 and self.n % rows == 0

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
