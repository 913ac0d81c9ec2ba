"""Paged attention: plain torch, plus a native decode kernel for the CPU.

The KV cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim].
Each step writes the new keys/values through a flat slot mapping, then attends:

* decodes (one query token each) sit first in the flattened batch and are done in one padded
  batch: their blocks are gathered whole (a block is one contiguous row, so this is a single
  index_select), padding points at the null block 0 and is masked out. The query heads that
  share a KV head are folded into the query-length axis, so GQA needs no K/V repeat;
* on the CPU in float32 the decodes instead go to a small C kernel (`native_attention`,
  compiled with the system C compiler on first use and cached; the torch path above is the
  fallback). It reads each sequence's K/V rows straight from their blocks, once: the gather
  copy, the padded mask and SDPA's blocking for 3-row queries cost more than the attention
  itself;
* each prefill chunk is done on its own: with no cached prefix it attends to its fresh K/V with
  a plain causal mask; after a cached prefix it gathers its blocks and uses a bool mask that is
  full over the prefix and causal inside the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slotserve.models.native_attention import native_decode


@dataclass(slots=True)
class PrefillSpan:
    """One request with more than one query token (or any request outside the decode group)."""

    start: int  # first token of the request in the flattened batch
    end: int
    num_computed: int  # tokens of this request already in the KV cache before this step
    # Only when num_computed > 0: the request's blocks covering its context, and the mask.
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [1, 1, num_query, context_len] additive: 0 or -inf


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer; built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int = 0  # the first num_decodes tokens are single-token requests
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * max_blocks] int64, 0 = pad
    # [num_decodes, 1, 1, max_blocks * block_size], additive (0 or -inf) in the model dtype:
    # a bool mask would be converted by SDPA in every layer.
    decode_mask: torch.Tensor | None = None
    decode_max_blocks: int = 0
    # Set when the decodes go to the native kernel (then decode_mask is None): [num_decodes]
    # int64 context lengths, and decode_block_ids is read as [num_decodes, max_blocks].
    decode_ctx_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Reused gather buffers [rows, block_size * kv_heads * head_dim], one for K and one for V.
    # Layers run one after another, so one pair serves every layer; without them each layer
    # allocates (and page-faults in) megabytes per gather.
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


def _gather(blocks: torch.Tensor, ids: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    if buf is None or buf.shape[0] < ids.numel() or buf.dtype != blocks.dtype:
        return blocks.index_select(0, ids)
    return torch.index_select(blocks, 0, ids, out=buf[:ids.numel()])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (this step's, already written) -> [T, H * D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    groups = num_heads // num_kv_heads
    k_blocks = k_cache.view(num_blocks, -1)
    v_blocks = v_cache.view(num_blocks, -1)

    nd = meta.num_decodes
    if nd and meta.decode_ctx_lens is not None:
        assert meta.decode_block_ids is not None
        o = native_decode(query[:nd], k_cache, v_cache, meta.decode_block_ids,
                          meta.decode_max_blocks, meta.decode_ctx_lens, scale)
        if not meta.prefills:
            return o
    elif nd:
        ctx = meta.decode_max_blocks * block_size
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        # [nd, ctx, KVH, D] viewed as [nd, KVH, ctx, D]; SDPA accepts the strided view.
        k = _gather(k_blocks, meta.decode_block_ids, meta.k_buf).view(nd, ctx, num_kv_heads,
                                                                       head_dim)
        v = _gather(v_blocks, meta.decode_block_ids, meta.v_buf).view(nd, ctx, num_kv_heads,
                                                                       head_dim)
        q = query[:nd].view(nd, num_kv_heads, groups, head_dim)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=meta.decode_mask, scale=scale)
        if not meta.prefills:  # a pure decode step: no scatter into a shared output
            return o.reshape(num_tokens, num_heads * head_dim)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if nd:
        out[:nd] = o.view(nd, num_heads, head_dim)

    for span in meta.prefills:
        n = span.end - span.start
        q = query[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.num_computed == 0:
            k = key[span.start:span.end]
            v = value[span.start:span.end]
            mask = None
        else:
            assert span.block_ids is not None and span.mask is not None
            ctx_len = span.num_computed + n
            nb = span.block_ids.numel()
            k = _gather(k_blocks, span.block_ids, meta.k_buf).view(
                nb * block_size, num_kv_heads, head_dim)[:ctx_len]
            v = _gather(v_blocks, span.block_ids, meta.v_buf).view(
                nb * block_size, num_kv_heads, head_dim)[:ctx_len]
            mask = span.mask
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None and n > 1, scale=scale,
            enable_gqa=groups > 1)
        out[span.start:span.end] = o[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)

