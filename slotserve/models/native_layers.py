"""A pure decode step's decoder layers in one native call (`csrc/q8layers.h`): `DecodeLayers`.

At one sequence a Gemma 3 270M layer is ten native calls (the norms, three int8 products
and the gated activation, q/k norm + RoPE + the K/V write, the attention), each a few to a
few dozen microseconds, and the Python around them (module calls, checks, allocations,
ctypes) cost about as much: ~3.5 ms of a 17 ms step measured on an AMD EPYC, and on two
threads the part that does not scale. Here a table of per-layer records (weights, norms,
caches, shapes) is built once, and each step fills one step record (its buffers, RoPE rows,
slot mapping, block table, context lengths, applied windows) and makes one call.

The C side runs the very kernels the modules run, with the same arguments and the same
split over threads, in the same order, so the hidden states are bit for bit those of the
module path (tests/models/test_native_layers.py). It runs only where every piece has that
path: the native glue (`NativeOps`) and attention, every projection an int8 `QMatmulPlan`
without bias, Gemma 3's or the Llama family's layer, and a step of decodes only (no
prefill chunk); anything else, and any change of plans or caches since the table was built
(which rebuilds it), is left to or checked against the modules.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slotserve.models import fused_lib, native_attention, native_fused
from slotserve.models.attention import AttentionMetadata, AttentionMetadataMap
from slotserve.models.decode_layers_abi import (
    KIND_GEMMA3,
    KIND_LLAMA,
    WINDOWS,
    LayerFns,
    LayerRec,
    MmRec,
    StepRec,
    layers_error,
)
from slotserve.models.fused import NATIVE_OPS, RMSNorm
from slotserve.models.kv_storage import KV_CODES, row_elems
from slotserve.models.native_build import NativeKernelError
from slotserve.models.qmatmul_lib import MAX_WEIGHTS_PER_CALL, PARALLEL_MIN_WORK
from slotserve.models.quantization import QuantizedLinear

if TYPE_CHECKING:
    from slotserve.models.layers import DecoderForCausalLM

logger = logging.getLogger(__name__)

_F32, _I64 = torch.float32, torch.int64


def enabled() -> bool:
    """`SLOTSERVE_DECODE_LAYERS=0` keeps every step on the module path (for comparisons)."""
    return os.environ.get("SLOTSERVE_DECODE_LAYERS", "1") != "0"


def _addr(fn: Any) -> int:
    value = ctypes.cast(fn, ctypes.c_void_p).value
    if not value:
        raise NativeKernelError("decode layers: a native function has no address")
    return int(value)


def _mm(linear: object) -> tuple[MmRec, object, int] | None:
    """The record of one projection's plan (with the plan, kept alive, and its scratch per
    row), or None when it has no single int8 call."""
    if type(linear) is not QuantizedLinear or not linear.int8 or linear.bias is not None \
            or len(linear.segments) > MAX_WEIGHTS_PER_CALL:
        return None
    plan = linear.plan()
    rec = MmRec(plan._addr, plan._nseg, plan.k, plan.columns, plan._work)
    return rec, plan, plan._row_scratch


def _norm_w(norm: object, d: int) -> int | None:
    if not isinstance(norm, RMSNorm):
        return None
    w = norm.weight
    if w.dtype != _F32 or not w.is_cpu or w.dim() != 1 or w.shape[0] != d \
            or not w.is_contiguous():
        return None
    return int(w.data_ptr())


@dataclass(slots=True)
class _Built:
    layers: ctypes.Array[LayerRec]
    plans: list[tuple[QuantizedLinear, object]]  # (module, its plan when built)
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    row_scratch: int  # the largest q8 scratch a row of any product needs
    widths: tuple[int, int, int, int, int, int]  # x, qkv, attn, o, gu, act per row
    windows: list[int | None]  # the configured window of each step.windows slot


class DecodeLayers:
    """The native decode path of one model (`DecoderForCausalLM.forward` asks it first)."""

    def __init__(self) -> None:
        self._built: _Built | None = None
        self._failed: str | None = None  # why this model has no native decode path
        self._fns: LayerFns | None = None
        self._call: Callable[..., int] | None = None
        self._step = StepRec()
        self._work = torch.empty(0, dtype=_F32)
        self._q8 = torch.empty(0, dtype=torch.uint8)

    # ------------------------------------------------------------- building the table
    def _build(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> _Built | str:
        """The layer table, or why this model cannot have one."""
        from slotserve.models.gemma3 import Gemma3DecoderLayer
        from slotserve.models.llama import DecoderLayer

        if fused_lib.loaded() is None or not callable(native_attention._native_fn):
            return "the native glue or attention kernel is not loaded"
        layers: list[Any] = list(model.model.layers)
        if len(kv_caches) != len(layers) or not layers:
            return "one KV cache per layer"
        cfg = model.config
        d = cfg.hidden_size
        recs = (LayerRec * len(layers))()
        plans: list[tuple[QuantizedLinear, object]] = []
        windows: list[int | None] = []
        row_scratch, lib, widths = 0, None, (0, 0, 0, 0, 0, 0)
        for i, (layer, (kc, vc)) in enumerate(zip(layers, kv_caches, strict=True)):
            kind = {Gemma3DecoderLayer: KIND_GEMMA3, DecoderLayer: KIND_LLAMA}.get(type(layer))
            if kind is None or layer.ops is not NATIVE_OPS:
                return f"layer {i} is not a native Gemma 3 or Llama layer"
            attn, mlp = layer.self_attn, layer.mlp
            if attn.ops is not NATIVE_OPS or mlp.ops is not NATIVE_OPS \
                    or mlp.act not in native_fused.ACT_CODES:
                return f"layer {i}: not the native glue"
            mms = [_mm(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                    mlp.down_proj)]
            if any(m is None for m in mms):
                return f"layer {i}: a projection is not one int8 call without bias"
            for mod, got in zip((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                                mms, strict=True):
                assert got is not None
                plans.append((mod, got[1]))
                row_scratch = max(row_scratch, got[2])
                plan_lib = got[1].weights[0].lib  # type: ignore[attr-defined]
                if lib is None:
                    lib = plan_lib
                elif plan_lib is not lib:
                    return "the products come from more than one kernel library"
            norms = [_norm_w(layer.input_layernorm, d), _norm_w(layer.post_attention_layernorm, d)]
            if kind == KIND_GEMMA3:
                norms += [_norm_w(layer.pre_feedforward_layernorm, d),
                          _norm_w(layer.post_feedforward_layernorm, d)]
            if any(w is None for w in norms):
                return f"layer {i}: a norm weight is not float32 [{d}]"
            hd, nh, kvh = attn.head_dim, attn.num_heads, attn.num_kv_heads
            qn = kn = None
            if attn.qk_norm:
                qn, kn = _norm_w(attn.q_norm, hd), _norm_w(attn.k_norm, hd)
                if qn is None or kn is None:
                    return f"layer {i}: a q/k norm weight is not float32 [{hd}]"
            code = KV_CODES.get(kc.dtype)
            if code is None or vc.dtype != kc.dtype or kc.shape != vc.shape or kc.dim() != 4 \
                    or not (kc.is_cpu and vc.is_cpu and kc.is_contiguous()
                            and vc.is_contiguous()) \
                    or kc.shape[2] != kvh or kc.shape[3] != row_elems(hd, kc.dtype):
                return f"layer {i}: the KV cache is not one the native kernels read"
            qkv, o, gu, down = (m[0] for m in mms if m is not None)
            inter = mlp.intermediate_size
            if qkv.k != d or qkv.columns != (nh + 2 * kvh) * hd or o.k != nh * hd \
                    or o.columns != d or gu.k != d or gu.columns != 2 * inter \
                    or down.k != inter or down.columns != d:
                return f"layer {i}: the projections' shapes do not chain"
            if attn.window not in windows:
                if len(windows) == WINDOWS:
                    return f"more than {WINDOWS} window sizes"
                windows.append(attn.window)
            eps = layer.input_layernorm.eps
            if any(n.eps != eps for n in (layer.post_attention_layernorm,
                                           *((layer.pre_feedforward_layernorm,
                                              layer.post_feedforward_layernorm)
                                             if kind == KIND_GEMMA3 else ()))):
                return f"layer {i}: the norms' eps differ"
            recs[i] = LayerRec(
                kind, norms[0], norms[1], norms[2] if kind == KIND_GEMMA3 else None,
                norms[3] if kind == KIND_GEMMA3 else None, qn, kn, eps,
                attn.q_norm.eps if attn.qk_norm else 0.0, attn.scale, qkv, o, gu, down, nh,
                kvh, hd, inter, native_fused.ACT_CODES[mlp.act], kc.data_ptr(), vc.data_ptr(),
                kc.shape[0], kc.shape[1], kc.shape[3] * kc.element_size(), code,
                int(model._local_rope[i]), windows.index(attn.window))
            widths = tuple(max(a, b) for a, b in zip(
                widths, (d, qkv.columns, nh * hd, d, 2 * inter, inter), strict=True))
        if lib is None or not hasattr(lib, "decode_layers"):
            return "the kernel library has no decode_layers"
        if self._fns is None:
            f = fused_lib.loaded()
            assert f is not None
            self._fns = LayerFns(_addr(f.rms_norm), _addr(f.add_rms_norm), _addr(f.rms_norm_add),
                             _addr(f.gated_act), _addr(f.qkv_rope_store),
                             _addr(native_attention._native_fn))
        self._call = lib.decode_layers
        return _Built(recs, plans, list(kv_caches), row_scratch, widths, windows)

    def _current(self, model: DecoderForCausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Built | None:
        """The table, rebuilt when a plan or a cache it points into was replaced."""
        built = self._built
        if built is not None:
            stale = len(kv_caches) != len(built.caches) or any(
                a[0] is not b[0] or a[1] is not b[1]
                for a, b in zip(kv_caches, built.caches, strict=True)) or any(
                mod._plan is not plan for mod, plan in built.plans)
            if not stale:
                return built
            self._built = None
        if self._failed is not None:
            return None
        got = self._build(model, kv_caches)
        if isinstance(got, str):
            self._failed = got
            logger.debug("decode layers: module path (%s)", got)
            return None
        self._built = got
        return got

    # ------------------------------------------------------------- a step
    def run(self, model: DecoderForCausalLM, h: torch.Tensor, rope: tuple[torch.Tensor, ...],
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            attn_metadata: AttentionMetadataMap) -> bool:
        """Run every layer on h [T, hidden] in place, if this step can; False: it cannot
        (nothing was touched). `rope`: cos, sin, local cos, local sin rows [T, 1, D]."""
        built = self._current(model, kv_caches)
        if built is None:
            return False
        m = h.shape[0]
        metas: list[AttentionMetadata] = []
        for w in built.windows:
            meta = attn_metadata.get(w)
            if meta is None or not meta.native or meta.prefills or meta.num_decodes != m:
                return False
            metas.append(meta)
        first = metas[0]
        table, ctx, scores = first.decode_block_ids, first.decode_ctx_lens, first.scratch
        if table is None or ctx is None or scores is None:
            return False
        for meta in metas[1:]:
            if meta.decode_block_ids is not table or meta.decode_ctx_lens is not ctx \
                    or meta.scratch is not scores:
                return False
        if h.dtype != _F32 or not h.is_cpu or h.dim() != 2 or not h.is_contiguous() \
                or h.shape[1] != built.widths[0] or m < 1:
            return False
        sm = first.slot_mapping
        if sm.dtype != _I64 or not sm.is_contiguous() or sm.shape != (m,) \
                or table.dtype != _I64 or not table.is_contiguous() or table.dim() != 2 \
                or table.shape[0] != m or ctx.dtype != _I64 or not ctx.is_contiguous() \
                or ctx.shape != (m,) or scores.dtype != _F32 or not scores.is_contiguous() \
                or scores.dim() != 2:
            return False
        hd = model.config.head_dim
        for t in rope:
            if t.dtype != _F32 or not t.is_contiguous() or t.numel() != m * hd:
                return False
        s = self._step
        widths = built.widths
        need = m * sum(widths)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=_F32)
        q8 = m * built.row_scratch
        if self._q8.numel() < q8:
            self._q8 = torch.empty(max(q8, 64 * 1024), dtype=torch.uint8)
        base = self._work.data_ptr()
        s.m, s.hidden, s.threads, s.min_work = m, widths[0], torch.get_num_threads(), \
            PARALLEL_MIN_WORK
        s.h = h.data_ptr()
        offs = [base]  # x, qkv, attn, o, gu, act: one slice of the workspace after another
        for w in widths[:-1]:
            offs.append(offs[-1] + 4 * m * w)
        s.x, s.qkv, s.attn, s.o, s.gu, s.act = offs
        s.cos[0], s.sin[0] = rope[0].data_ptr(), rope[1].data_ptr()
        s.cos[1], s.sin[1] = rope[2].data_ptr(), rope[3].data_ptr()
        s.slot_mapping, s.block_table, s.ctx_lens = sm.data_ptr(), table.data_ptr(), \
            ctx.data_ptr()
        s.max_blocks = table.shape[1]
        for j, meta in enumerate(metas):
            s.windows[j] = meta.window or 0
        s.scores, s.score_rows, s.score_len = scores.data_ptr(), scores.shape[0], \
            scores.shape[1]
        s.q8, s.q8_len = self._q8.data_ptr(), self._q8.numel()
        assert self._call is not None and self._fns is not None
        rc = self._call(ctypes.byref(self._fns), built.layers, len(built.layers),
                        ctypes.byref(s))
        if rc != 0:
            raise layers_error("decode layers", rc)
        return True
