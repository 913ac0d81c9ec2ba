"""RMSNorm and the elementwise glue of a decoder layer behind one interface: the torch reference
(`TorchOps`, transformers' formulas op for op) and the fused native kernels (`NativeOps`,
models/native_fused.py) for float32 on the CPU.

A model picks one set for its dtype and device in `DecoderForCausalLM.init_attention` and
hands it to its layers; the tests run both and compare. The operations:

- `norm(norm, x)`: an RMSNorm module applied to rows;
- `add_norm(h, x, norm)`: h += x in place, then norm(h) (Llama's residual order);
- `norm_add(h, x, norm, next_norm)`: h += norm(x) in place, then next_norm(h) if given
  (Gemma 3's: each block's output is normed before it joins the residual);
- `gated_act(gate_up, act)`: act(gate) * up of the fused gate/up projection;
- `qkv_rope_store(attn, qkv, cos, sin, kv_cache, slot_mapping)`: q/k per-head norm, RoPE,
  and this step's K/V written into the paged cache; returns q, k, v as [T, heads, D] views;
- `rope_rows(cos, sin, positions)`: the step's rows of the half RoPE tables as the [T, 1, D]
  (c, c) and (-s, s) that `apply_rope` and `qkv_rope_store` take.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.models import native_fused
from slotserve.models.kv_storage import write_kv

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # The fused kernel is bit-identical to the formula below in float32, and one op.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class AttentionShape(Protocol):
    """What the glue reads from an attention layer (layers.Attention)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def q_norm(self) -> RMSNorm: ...
    @property
    def k_norm(self) -> RMSNorm: ...


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelConfig.hidden_act -> the MLP's gate activation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos [T, 1, D] = (c, c); sin [T, 1, D] = (-s, s).

    The rotate-half convention of HF checkpoints, x * cos + rotate_half(x) * sin, with the sign
    of rotate_half folded into the sin table: rolling x by D/2 swaps its halves, so this is
    four ops and bit-identical to the unfused formula.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def split_qkv(attn: AttentionShape, qkv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, h, kvh, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    return (qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d),
            qkv[:, (h + kvh) * d:].view(t, kvh, d))


class TorchOps:
    """The reference: plain torch, any dtype and device."""

    native = False

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = norm(x)
        return out

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        return torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        h.add_(x)
        out: torch.Tensor = norm(h)
        return out

    def norm_add(self, h: torch.Tensor, x: torch.Tensor, norm: RMSNorm,
                 next_norm: RMSNorm | None) -> torch.Tensor | None:
        h.add_(norm(x))
        return None if next_norm is None else next_norm(h)

    def gated_act(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        return ACTIVATIONS[act](gate_up[:, :inter]) * gate_up[:, inter:]

    def qkv_rope_store(self, attn: AttentionShape, qkv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_qkv(attn, qkv)
        if attn.qk_norm:
            q = apply_rope(attn.q_norm(q), cos, sin)
            k = apply_rope(attn.k_norm(k), cos, sin)
        else:
            # q and k rotated together: one set of elementwise kernels instead of two.
            t, h = qkv.shape[0], attn.num_heads
            qk = apply_rope(qkv[:, :(h + attn.num_kv_heads) * attn.head_dim].view(
                t, h + attn.num_kv_heads, attn.head_dim), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        write_kv(kv_cache, k, v, slot_mapping)
        return q, k, v


class NativeOps(TorchOps):
    """The fused C kernels; only for float32 tensors on the CPU (native_fused_supported)."""

    native = True

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return native_fused.rms_norm(x, norm.weight, norm.eps)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return native_fused.add_rms_norm(h, x, norm.weight, norm.eps)

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        # One call instead of four torch operators per table, each run with its code out of
        # the caches after the output projection streamed its weights.
        return native_fused.rope_rows(cos, sin, positions)

    def norm_add(self, h: torch.Tensor, x: torch.Tensor, norm: RMSNorm,
                 next_norm: RMSNorm | None) -> torch.Tensor | None:
        return native_fused.rms_norm_add(h, x, norm.weight, norm.eps,
                                         None if next_norm is None else next_norm.weight)

    def gated_act(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        return native_fused.gated_act(gate_up, act)

    def qkv_rope_store(self, attn: AttentionShape, qkv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qw = attn.q_norm.weight if attn.qk_norm else None
        kw = attn.k_norm.weight if attn.qk_norm else None
        eps = attn.q_norm.eps if attn.qk_norm else 0.0
        native_fused.qkv_rope_store(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                    qw, kw, eps, cos, sin, kv_cache[0], kv_cache[1],
                                    slot_mapping)
        return split_qkv(attn, qkv)


TORCH_OPS = TorchOps()
NATIVE_OPS = NativeOps()


def choose_ops(dtype: torch.dtype, device: torch.device, native: bool) -> TorchOps:
    """The native ops where they build for this dtype and device and `native` allows."""
    if native and native_fused_ok(dtype, device):
        return NATIVE_OPS
    return TORCH_OPS


def native_fused_ok(dtype: torch.dtype, device: torch.device) -> bool:
    return native_fused.native_fused_supported(dtype, device)
