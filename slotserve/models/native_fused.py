"""The fused elementwise ops of a decoder layer in native C (`csrc/fused_ops.c`), for float32
on the CPU.

At one sequence a Gemma 3 270M decode step ran ~110 RMSNorms, 36 RoPEs and the attention glue
as chains of torch operators (`pow`, `mean`, `rsqrt`, `mul`, `_to_copy`, `roll`, `index_copy_`
...), each a few microseconds of dispatch around nanoseconds of work: about 8 ms of the 19 ms
the layers took. Here each piece is one call: RMSNorm with its residual add, the gated MLP
activation, and q/k norm + RoPE + the K/V cache write.

`models/fused.py` chooses between these and the torch reference (`TorchOps`, the formulas
transformers uses, which the tests compare against). The library is built like the decode
kernel (`native_build.load_kernel`); when it cannot be built `native_fused_supported` says no
and the model keeps the torch ops. Every function checks its tensors (dtype, device, shape,
strides) and raises `NativeKernelError`; the C code checks the slot ids it writes to.
"""

from __future__ import annotations

import torch

from slotserve.models import fused_lib
from slotserve.models.fused_lib import ACT_CODES, FusedLib
from slotserve.models.kv_storage import KV_CODES, row_elems
from slotserve.models.native_build import NativeKernelError

__all__ = ["ACT_CODES", "native_fused_supported"]

def native_fused_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this model's layers can use the fused native ops (building them on first
    call; a failed build is logged once and cached)."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    return fused_lib.load() is not None


def _get() -> FusedLib:
    lib = fused_lib.loaded()
    if lib is None:
        raise NativeKernelError("fused ops: called before native_fused_supported() built them")
    return lib


# The checks run on every call, so they are plain comparisons; messages are only built for a
# failure.
_F32 = torch.float32


def _fail(what: str) -> NativeKernelError:
    return NativeKernelError(f"fused ops: {what}")


def _rows(x: torch.Tensor, d: int, name: str) -> None:
    """x is float32 CPU [rows, d] with contiguous rows."""
    if x.dtype != _F32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != d or x.stride(1) != 1:
        raise _fail(f"{name} must be float32 CPU [rows, {d}] with contiguous rows, got "
                    f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")


def _weight(w: torch.Tensor, d: int) -> None:
    if w.dtype != _F32 or not w.is_cpu or w.dim() != 1 or w.shape[0] != d \
            or not w.is_contiguous():
        raise _fail(f"norm weight must be float32 CPU [{d}] contiguous, got {w.dtype} "
                    f"{tuple(w.shape)}")


def _residual(h: torch.Tensor, x: torch.Tensor, d: int) -> None:
    _rows(h, d, "h")
    if not h.is_contiguous() or h.shape[0] != x.shape[0]:
        raise _fail("h must be contiguous, with as many rows as x")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight for x [rows, d]: a new contiguous tensor."""
    d = weight.shape[0]
    _rows(x, d, "x")
    _weight(weight, d)
    out = torch.empty(x.shape[0], d)
    _get().rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), d,
                    x.shape[0], d, eps)
    return out


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> torch.Tensor:
    """h += x in place, then norm(h) * weight (new)."""
    d = weight.shape[0]
    _rows(x, d, "x")
    _residual(h, x, d)
    _weight(weight, d)
    out = torch.empty(h.shape[0], d)
    _get().add_rms_norm(h.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(),
                        out.data_ptr(), h.shape[0], d, eps)
    return out


def rms_norm_add(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 next_weight: torch.Tensor | None) -> torch.Tensor | None:
    """h += norm(x) * weight in place; then norm(h) * next_weight (new), if it is given."""
    d = weight.shape[0]
    _rows(x, d, "x")
    _residual(h, x, d)
    _weight(weight, d)
    out = None
    if next_weight is not None:
        _weight(next_weight, d)
        out = torch.empty(h.shape[0], d)
    _get().rms_norm_add(h.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(),
                        None if next_weight is None else next_weight.data_ptr(),
                        None if out is None else out.data_ptr(), h.shape[0], d, eps)
    return out


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2 * inter] = (gate, up): [rows, inter] (new)."""
    code = ACT_CODES.get(act)
    if code is None:
        raise _fail(f"unknown activation {act!r}")
    if gate_up.dtype != _F32 or not gate_up.is_cpu or gate_up.dim() != 2 \
            or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise _fail("gate_up must be contiguous float32 CPU [rows, 2 * intermediate]")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    _get().gated_act(gate_up.data_ptr(), rows, inter, out.data_ptr(), code)
    return out


def qkv_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In qkv [rows, (H + 2 KVH) * D]: q and k heads normed (weights given) and rotated in
    place with cos / sin [rows, D]; k and v rows written to the caches at slot_mapping.

    Caches [num_blocks, block_size, KVH, row] contiguous: float32 / bfloat16 / float16 rows
    of D, or int8 rows of D values and their block scales (models/kv_storage.py)."""
    rows = qkv.shape[0]
    _rows(qkv, (num_heads + 2 * num_kv_heads) * head_dim, "qkv")
    for t in (cos, sin):
        if t.dtype != _F32 or not t.is_cpu or not t.is_contiguous() \
                or t.numel() != rows * head_dim:
            raise _fail(f"cos and sin must be contiguous float32 CPU [rows, {head_dim}]")
    for w in (q_weight, k_weight):
        if w is not None:
            _weight(w, head_dim)
    code = KV_CODES.get(k_cache.dtype)
    if code is None or v_cache.dtype != k_cache.dtype or k_cache.shape != v_cache.shape \
            or k_cache.dim() != 4 or not k_cache.is_cpu or not v_cache.is_cpu \
            or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise _fail("K and V caches must be alike, contiguous, on the CPU, of a known "
                    "storage type")
    num_blocks, block_size, kvh, row = k_cache.shape
    if kvh != num_kv_heads or row != row_elems(head_dim, k_cache.dtype):
        raise _fail(f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not hold "
                    f"{num_kv_heads} heads of {head_dim}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_cpu \
            or not slot_mapping.is_contiguous() or slot_mapping.shape != (rows,):
        raise _fail(f"slot_mapping must be int64 CPU [{rows}]")
    rc = _get().qkv_rope_store(
        qkv.data_ptr(), qkv.stride(0), rows, num_heads, num_kv_heads, head_dim,
        None if q_weight is None else q_weight.data_ptr(),
        None if k_weight is None else k_weight.data_ptr(), eps, cos.data_ptr(),
        sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks * block_size,
        slot_mapping.data_ptr(), code, row * k_cache.element_size())
    if rc != 0:
        raise _fail("a slot id is outside the KV cache")


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `positions` of the half tables cos, sin [max_pos, D / 2], as [T, 1, D]
    (c, c) and (-s, s), as `TorchOps.rope_rows` (models/fused.py) builds them with torch."""
    if cos.dtype != _F32 or sin.dtype != _F32 or not cos.is_cpu or not sin.is_cpu \
            or cos.dim() != 2 or cos.shape != sin.shape or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise _fail("RoPE tables must be alike, contiguous float32 CPU [positions, D / 2]")
    if positions.dtype != torch.int64 or not positions.is_cpu or positions.dim() != 1 \
            or not positions.is_contiguous():
        raise _fail("positions must be contiguous int64 CPU [rows]")
    rows, (max_pos, half) = positions.shape[0], cos.shape
    out = torch.empty(2, rows, 1, 2 * half)
    rc = _get().rope_rows(cos.data_ptr(), sin.data_ptr(), half, max_pos, positions.data_ptr(),
                          rows, out.data_ptr(), out[1].data_ptr())
    if rc != 0:
        raise IndexError(f"a position is outside the RoPE tables of {max_pos} positions")
    return out[0], out[1]
