"""The native quantized-matmul library (`csrc/qmatmul.c`) as ctypes sees it: how it is
built, its functions' signatures, which GGML types it runs and how their blocks are laid
out. Torch-free, so an engine core without torch (the native runner) loads the same library
the torch modules (`native_qmatmul`, `native_qmatmul_plan`) call."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

from gguf import GGMLQuantizationType as Q

from slotserve.errors import ConfigError
from slotserve.models.native_build import (
    CSRC,
    CpuLevel,
    KernelSource,
    NativeKernelError,
    cpu_level,
    cpu_vendor,
    load_kernel,
    supported_levels,
)

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


class QMatmulLib:
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


    def can_repack(self, qtype: int, rows: int) -> bool:
        """Whether this build multiplies a `rows`-row weight of `qtype` faster in its
        interleaved layout (csrc/q8repack.h: Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K, in groups of 16
        rows with AVX-512 VNNI, of 8 with AVX2; the rows a multiple of the group)."""
        group = self.repack_rows[qtype]
        return group > 0 and rows % group == 0


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
_lib: QMatmulLib | bool | None = None
_level_libs: dict[str, QMatmulLib | None] = {}
_lock = threading.Lock()


def qmatmul_available() -> bool:
    """Whether the kernel builds and loads here (building it on the first call)."""
    global _lib
    with _lock:
        if _lib is None:
            dll = load_kernel(KERNEL, "quantized weights are dequantized at load")
            _lib = QMatmulLib(dll) if dll is not None else False
    return _lib is not False


def level_library(level: CpuLevel) -> QMatmulLib | None:
    """The kernel built for one CPU level (tests and benchmarks compare levels); None when
    it does not build (logged)."""
    with _lock:
        if level.name not in _level_libs:
            dll = load_kernel(KERNEL, f"level {level.name}", level)
            _level_libs[level.name] = QMatmulLib(dll) if dll is not None else None
        return _level_libs[level.name]


def load() -> QMatmulLib | None:
    """The library, built on the first call; None when it cannot be (logged once)."""
    return _lib if qmatmul_available() and isinstance(_lib, QMatmulLib) else None


def _library() -> QMatmulLib:
    if not isinstance(_lib, QMatmulLib):
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


_ERRORS = {1: "the weight type has no kernel",
           2: "the shape does not fit the type's block layout or the row range is bad",
           3: "the scratch buffer is too small",
           4: "a row id is outside the weight"}
# Below this many multiply-adds per call (about 15 us of one core's work) a second thread is
# not worth its hand-off. The helpers (csrc/q8pool.h) cost the caller little even when they
# are late: it runs the chunks they have not claimed and takes back a job not started. So at
# one sequence every matrix of Gemma 3 270M's layers splits (the smallest, o_proj, is 655k);
# OpenMP's team, whose barrier waits for a descheduled member, needed a 16M bar here.
PARALLEL_MIN_WORK = 1 << 18
MAX_WEIGHTS_PER_CALL = 8  # q8call.h's Q8X_MAX_SEGS


def kernel_error(what: str, rc: int) -> NativeKernelError:
    return NativeKernelError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


class QmmSeg(ctypes.Structure):
    """q8call.h's qmm_seg, field for field."""

    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("col", ctypes.c_int64), ("type", ctypes.c_int32), ("packed", ctypes.c_int32)]
