"""How the paged KV cache stores a row (one token's one KV head): the torch reference of
`--kv-cache-dtype` (vLLM's flag).

- float32, bfloat16, float16: the row is head_dim values of that type;
- int8: head_dim int8 values, then their float32 scale in the row's last 4 bytes (a row is
  head_dim + 4 bytes). The scale is absmax / 127 and a value round(x / scale), halves to
  even: llama.cpp's q8_0 scheme with one block per token and head, so a token's row is final
  when written (a scale per cache block would have to grow, and requantize the block, as its
  tokens arrive).

The native kernels (csrc/fused_ops.c writes, csrc/paged_decode.c reads) store and read the
same bytes; the tests compare them against these functions.
"""

from __future__ import annotations

import torch

from slotserve.config import check_kv_cache_dtype

_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int8": torch.int8}
SCALE_BYTES = 4
# The storage type codes of the native kernels (the enums in csrc/fused_ops.c, paged_decode.c).
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}

KVCache = tuple[torch.Tensor, torch.Tensor]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage type of `--kv-cache-dtype name`: auto is the model's dtype."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else _BY_NAME[name]


def row_elems(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of the cache tensor per token and head (int8: the values, then the scale)."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    return row_elems(head_dim, kv_dtype) * torch.empty(0, dtype=kv_dtype).element_size()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> int8 rows [..., D + 4]: values, then the float32 scale's bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inv).to(torch.int8)
    return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] -> values [..., head_dim] in `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def write_kv(kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's key/value [T, KVH, D] into the cache rows at slot_mapping."""
    k_cache, v_cache = kv_cache
    num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
    for cache, x in ((k_cache, key), (v_cache, value)):
        rows = quantize_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype)
        cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, rows)
