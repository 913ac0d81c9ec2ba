"""The records `slotserve_decode_layers` (csrc/q8layers.h) reads, field for field: a
model's table of layers (weights, norms, caches, shapes) and one step's buffers. Torch-free:
the torch model's `DecodeLayers` and the native runner fill the same records."""

from __future__ import annotations

import ctypes

from slotserve.models.native_build import NativeKernelError

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
KIND_GEMMA3, KIND_LLAMA = 0, 1
WINDOWS = 4  # q8layers.h's QL_WINDOWS
OPS = {1: "q/k/v product", 2: "q/k norm, RoPE and K/V write", 3: "attention",
        4: "o_proj", 5: "gate/up product", 6: "down_proj"}


class LayerFns(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("rms_norm", "add_rms_norm", "rms_norm_add",
                                        "gated_act", "qkv_rope_store", "paged_decode")]


class MmRec(ctypes.Structure):
    _fields_ = [("segs", _P), ("nseg", _I), ("k", _I), ("columns", _I), ("work", _I)]


class LayerRec(ctypes.Structure):
    _fields_ = [("kind", _I), ("in_w", _P), ("post_attn_w", _P), ("pre_ff_w", _P),
                ("post_ff_w", _P), ("q_norm_w", _P), ("k_norm_w", _P), ("eps", _D),
                ("qk_eps", _D), ("scale", _D), ("qkv", MmRec), ("o", MmRec), ("gate_up", MmRec),
                ("down", MmRec), ("nh", _I), ("kvh", _I), ("head_dim", _I), ("inter", _I),
                ("act", _I), ("k_cache", _P), ("v_cache", _P), ("num_blocks", _I),
                ("block_size", _I), ("row_bytes", _I), ("kv_code", _I), ("rope", _I),
                ("window", _I)]


class StepRec(ctypes.Structure):
    _fields_ = [("m", _I), ("hidden", _I), ("threads", _I), ("min_work", _I),
                *((name, _P) for name in ("h", "x", "qkv", "attn", "o", "gu", "act")),
                ("cos", _P * 2), ("sin", _P * 2), ("slot_mapping", _P), ("block_table", _P),
                ("ctx_lens", _P), ("max_blocks", _I), ("windows", _I * WINDOWS),
                ("scores", _P), ("score_rows", _I), ("score_len", _I), ("q8", _P),
                ("q8_len", _I)]


def layers_error(what: str, rc: int) -> NativeKernelError:
    """`slotserve_decode_layers`' return code as an error: which layer, which call, why."""
    layer, op, code = (rc >> 16) - 1, (rc >> 8) & 0xff, rc & 0xff
    return NativeKernelError(f"{what}: layer {layer}, {OPS.get(op, op)}: native error {code}")
