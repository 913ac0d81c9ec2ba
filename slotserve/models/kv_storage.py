"""How the paged KV cache stores a row (one token's one KV head): the torch reference of
`--kv-cache-dtype` (vLLM's flag).

- float32, bfloat16, float16: the row is head_dim values of that type;
- int8: llama.cpp's q8_0 cache along the row. The head_dim values in blocks of 32 (one block
  when head_dim is no multiple of 32), each value round(x / scale) (halves to even), scale =
  the block's absmax / 127, then every block's scale as float16: a row is
  head_dim + 2 * head_dim / 32 bytes (272 for head_dim 256, 3.76x fewer than float32). A row is
  final when written; a scale per cache block of tokens would have to grow, and requantize
  the block, as its tokens arrive.

The native kernels (csrc/fused_ops.c writes, csrc/paged_decode.c reads) store and read the
same bytes; the tests compare them against these functions.
"""

from __future__ import annotations

import torch

from slotserve.config import (
    KV_STORAGE_CODES,
    int8_block,
    kv_cache_dtype_name,
    kv_row_elems,
)

_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int8": torch.int8}
# The storage type codes of the native kernels, by torch dtype.
KV_CODES = {_BY_NAME[name]: code for name, code in KV_STORAGE_CODES.items()}

KVCache = tuple[torch.Tensor, torch.Tensor]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype,
                           gguf: bool = False) -> torch.dtype:
    """The storage type of `--kv-cache-dtype name` (config.kv_cache_dtype_name says which)."""
    model = str(model_dtype).removeprefix("torch.")
    return _BY_NAME.get(kv_cache_dtype_name(name, model, gguf), model_dtype)


def row_elems(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of the cache tensor per token and head (config.kv_row_elems)."""
    return kv_row_elems(head_dim, str(kv_dtype).removeprefix("torch."))


def row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    return row_elems(head_dim, kv_dtype) * torch.empty(0, dtype=kv_dtype).element_size()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> int8 rows [..., D + 2 * blocks]: values, then the float16 scales'
    bytes."""
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // int8_block(d), int8_block(d))
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inv).to(torch.int8).reshape(x.shape)
    scales = scale.squeeze(-1).to(torch.float16).contiguous().view(torch.int8)
    return torch.cat((q, scales), dim=-1)


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] -> values [..., head_dim] in `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    qk = int8_block(head_dim)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    values = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // qk, qk)
    return (values * scale.unsqueeze(-1)).reshape(*rows.shape[:-1], head_dim).to(dtype)


def write_kv(kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's key/value [T, KVH, D] into the cache rows at slot_mapping."""
    k_cache, v_cache = kv_cache
    num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
    for cache, x in ((k_cache, key), (v_cache, value)):
        rows = quantize_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype)
        cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, rows)
