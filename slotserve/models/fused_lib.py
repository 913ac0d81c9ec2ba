"""The fused-ops library (`csrc/fused_ops.c`) as ctypes sees it: how it is built and its
functions' signatures. Torch-free: the torch ops (`native_fused`) and the native runner call
the same library."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from slotserve.models import native_build
from slotserve.models.native_build import CSRC, KernelSource

KERNEL = KernelSource(
    "fused_ops", CSRC / "fused_ops.c",
    # No contraction into FMAs: the torch formulas round after every multiply.
    ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
     "-ffp-contract=off", "-shared", "-fPIC"),
    (("-DUSE_MVEC", "-lmvec", "-lm"), ("-lm",)))

ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class FusedLib:
    def __init__(self, dll: ctypes.CDLL) -> None:
        def fn(name: str, args: list[type], res: type | None = None) -> Callable[..., int]:
            f = getattr(dll, name)
            f.argtypes, f.restype = args, res
            return f  # type: ignore[no-any-return]

        self.rms_norm = fn("slotserve_rms_norm", [_P, _I, _P, _P, _I, _I, _I, _F])
        self.add_rms_norm = fn("slotserve_add_rms_norm", [_P, _P, _I, _P, _P, _I, _I, _F])
        self.rms_norm_add = fn("slotserve_rms_norm_add",
                               [_P, _P, _I, _P, _P, _P, _I, _I, _F])
        self.gated_act = fn("slotserve_gated_act", [_P, _I, _I, _P, _C])
        self.qkv_rope_store = fn("slotserve_qkv_rope_store",
                                 [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P, _I, _P,
                                  _C, _I], ctypes.c_int)
        self.rope_rows = fn("slotserve_rope_rows", [_P, _P, _I, _I, _P, _I, _P, _P],
                            ctypes.c_int)


# None: not tried yet; False: unavailable (already logged).
_lib: FusedLib | bool | None = None


def load() -> FusedLib | None:
    """The library, built on the first call; None when it cannot be (logged once)."""
    global _lib
    if _lib is None:
        dll = native_build.load_kernel(KERNEL, "the layers use the torch ops")
        _lib = FusedLib(dll) if dll is not None else False
    return _lib if isinstance(_lib, FusedLib) else None


def loaded() -> FusedLib | None:
    """The library if a `load()` built it, without trying."""
    return _lib if isinstance(_lib, FusedLib) else None
