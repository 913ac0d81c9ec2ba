"""The paged decode-attention kernel (`csrc/paged_decode.c`) as ctypes sees it: how it is
built and its signature. Torch-free: `native_attention` (the torch path's checks around it)
and the native runner call the same function."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from slotserve.models import native_build
from slotserve.models.native_build import CSRC, KernelSource

SOURCE = CSRC / "paged_decode.c"
# Tried in order: the vectorized expf from libmvec, then plain libm.
KERNEL = KernelSource(
    "paged_decode", SOURCE,
    ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
     "-shared", "-fPIC"),
    (("-DUSE_MVEC", "-lmvec", "-lm"), ("-lm",)))

KernelFn = Callable[..., int]
# None: not tried yet; False: unavailable (already logged); else the ctypes function.
_fn: KernelFn | bool | None = None


def bind(lib: Path | ctypes.CDLL) -> KernelFn:
    """The library's `slotserve_paged_decode`, its argument types set."""
    dll = lib if isinstance(lib, ctypes.CDLL) else ctypes.CDLL(str(lib))
    fn = dll.slotserve_paged_decode
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, p, i, p, i, p, i, p, i, p, i, i, i, i, i, i, i, ctypes.c_float, i,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    bound: KernelFn = fn
    return bound


def load() -> KernelFn | None:
    """The kernel, compiled (or reused) and loaded once; None, after logging why, when that
    fails (cached, so it is logged once)."""
    global _fn
    if _fn is None:
        dll = native_build.load_kernel(KERNEL, "decode attention uses the torch path")
        _fn = False if dll is None else bind(dll)
    return _fn if callable(_fn) else None
