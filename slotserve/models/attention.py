"""Paged attention for full and sliding-window layers: plain torch, plus a native decode kernel.

The KV cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim].
Each step writes the new keys/values through a flat slot mapping, then attends:

* decodes (one query token each) sit first in the flattened batch and are done in one padded
  batch: their blocks are gathered whole (a block is one contiguous row, so this is a single
  index_select), padding points at the null block 0 and is masked out. The query heads that
  share a KV head are folded into the query-length axis, so GQA needs no K/V repeat;
* on the CPU in float32 the decodes instead go to a small C kernel (`native_attention`; the
  torch path above is the fallback and the reference). It reads each sequence's K/V rows
  straight from their blocks, once: the gather copy, the padded mask and SDPA's blocking for
  3-row queries cost more than the attention itself;
* each prefill chunk is done on its own: with no cached prefix it attends to its fresh K/V with
  a plain causal mask; after a cached prefix it gathers its blocks and uses an additive mask
  that is full over the prefix and causal inside the chunk.

A sliding window of W tokens (transformers' rule: a query at position p sees keys at positions
> p - W) narrows every path: decodes and cached-prefix chunks gather only the blocks from the
first one the window reaches, the kernel skips the blocks before it, and masks cut the rest.
Every layer still writes every token to its own blocks; which blocks a window no longer
reaches could be freed (docs/ATTENTION.md). A window that no sequence of the step outgrows is
no window at all, so such layers share the full-attention metadata.

The attention layer owns this: `AttentionBackend` (one per model) decides torch or native once,
turns the worker's `BatchLayout` into one `AttentionMetadata` per window size each step, and
owns the reused buffers; `paged_attention` runs one layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from slotserve.models.kv_storage import dequantize_rows
from slotserve.models.native_attention import native_decode_supported, paged_decode


@dataclass(slots=True)
class BatchLayout:
    """The worker's description of a step (numpy on the CPU), requests in batch order with the
    single-token ones first; the attention layer builds its metadata from it."""

    block_table: np.ndarray  # [rows, max_blocks_per_req] int64 block ids, one row per slot
    slots: np.ndarray  # [num_reqs] int64: each request's row of block_table
    q_lens: np.ndarray  # [num_reqs] int64 tokens scheduled this step
    num_computed: np.ndarray  # [num_reqs] int64 tokens already in the KV cache
    # The first num_decodes requests are decodes: one token each, or a token and its drafts
    # (every query attends as a decode of its own position would).
    num_decodes: int
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the model's device


@dataclass(slots=True)
class PrefillSpan:
    """One request with more than one query token (or any request outside the decode group)."""

    start: int  # first token of the request in the flattened batch
    end: int
    # Set when the span reads K/V from the cache (after a cached prefix or earlier chunks):
    # its blocks from the first one its window reaches, and how many keys from that block's
    # start it attends over (the mask's last dimension).
    block_ids: torch.Tensor | None = None
    context_len: int = 0
    # [1, 1, num_query, keys] additive (0 or -inf); None: plain causal over its own fresh K/V.
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs for the layers of one window size."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    window: int | None = None  # as applied this step (None: attend to the whole context)
    num_decodes: int = 0  # the first num_decodes tokens are decode queries
    native: bool = False  # the decodes go to the native kernel
    # Native: [num_decodes, max_blocks] from each sequence's first block. Torch: flattened
    # [num_decodes * max_blocks] from the first block in the window, padded with 0.
    decode_block_ids: torch.Tensor | None = None
    decode_max_blocks: int = 0
    # Torch: [num_decodes, 1, 1, max_blocks * block_size], additive (0 or -inf) in the model
    # dtype: a bool mask would be converted by SDPA in every layer.
    decode_mask: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None  # native: [num_decodes] int64 context lengths
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Buffers shared by every layer (layers run one after another; allocating per layer would
    # page-fault in megabytes per step): gather rows [rows, block_size * kv_heads * head_dim]
    # for K and V, the output [num_tokens, heads * head_dim], the native kernel's scores.
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    out: torch.Tensor | None = None
    scratch: torch.Tensor | None = None


# Each layer looks up the metadata of its own configured window (None: full attention).
AttentionMetadataMap = dict[int | None, AttentionMetadata]


class AttentionBackend:
    """Chooses the decode kernel for one model and builds each step's metadata."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 windows: Iterable[int | None], dtype: torch.dtype, device: torch.device,
                 native: bool = True) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
        self.dtype, self.device = dtype, device
        # Decodes read K/V straight from the blocks when the native kernel builds (CPU fp32).
        self.native = native and native_decode_supported(dtype, device, head_dim)
        self._gather = torch.empty(2, 0, 0, dtype=dtype, device=device)
        self._out = torch.empty(0, num_heads * head_dim, dtype=dtype, device=device)
        self._scratch = torch.empty(0, 0, dtype=torch.float32)

    def build(self, layout: BatchLayout) -> AttentionMetadataMap:
        longest = int((layout.num_computed + layout.q_lens).max())
        queries = decode_queries(layout)  # one (row, context) per decode query, for every build
        # The kernel applies a window itself, so every window shares one native block table.
        native_decodes = self._native_decodes(layout, queries) if self.native else None
        built: dict[int | None, AttentionMetadata] = {}
        by_window: AttentionMetadataMap = {}
        for window in self.windows:
            applied = window if window is not None and window < longest else None
            if applied not in built:
                built[applied] = self._build(layout, applied, native_decodes, queries)
            by_window[window] = built[applied]
        metas = list(built.values())
        num_tokens = layout.slot_mapping.shape[0]
        if self._out.shape[0] < num_tokens:  # grown to the largest step seen, never shrunk
            self._out = self._out.new_empty(max(num_tokens, 2 * self._out.shape[0]),
                                            self._out.shape[1])
        out = self._out[:num_tokens]
        rows = max(max((m.decode_block_ids.numel() for m in metas
                        if m.decode_block_ids is not None and not m.native), default=0),
                   max((s.block_ids.numel() for m in metas for s in m.prefills
                        if s.block_ids is not None), default=0))
        block_elems = layout.block_size * self.num_kv_heads * self.head_dim
        if rows and (self._gather.shape[1] < rows or self._gather.shape[2] != block_elems):
            self._gather = self._gather.new_empty(2, max(rows, 2 * self._gather.shape[1]),
                                                  block_elems)
        scratch = (self._native_scratch(layout, queries[1]) if self.native and layout.num_decodes
                   else None)
        for m in metas:
            m.out, m.scratch = out, scratch
            if rows:
                m.k_buf, m.v_buf = self._gather[0], self._gather[1]
        return by_window

    def _native_scratch(self, layout: BatchLayout, ctx: np.ndarray) -> torch.Tensor:
        """Score rows for the kernel, one per thread: heads * the longest context decoded."""
        longest = int(ctx.max())
        per_thread = self.num_heads * math.ceil(longest / layout.block_size) * layout.block_size
        threads = max(1, min(torch.get_num_threads(), len(ctx)))
        have_threads, have = self._scratch.shape
        if have_threads < threads or have < per_thread:
            self._scratch = torch.empty(max(threads, have_threads),
                                        have if have >= per_thread else max(per_thread, 2 * have))
        return self._scratch

    @staticmethod
    def _native_decodes(layout: BatchLayout, queries: tuple[np.ndarray, np.ndarray]
                        ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The decodes' block-table rows from block 0 and their context lengths (CPU)."""
        if not layout.num_decodes:
            return None
        rows, ctx = queries
        max_blocks = math.ceil(int(ctx.max()) / layout.block_size)
        table = np.ascontiguousarray(layout.block_table[rows, :max_blocks])
        return torch.from_numpy(table), torch.from_numpy(ctx), max_blocks

    def _mask(self, allowed: np.ndarray) -> torch.Tensor:
        mask = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
        return torch.from_numpy(mask).to(device=self.device, dtype=self.dtype)

    def _build(self, layout: BatchLayout, window: int | None,
               native_decodes: tuple[torch.Tensor, torch.Tensor, int] | None,
               queries: tuple[np.ndarray, np.ndarray]) -> AttentionMetadata:
        bs, nd, dev = layout.block_size, layout.num_decodes, self.device
        rows, ctx = queries
        meta = AttentionMetadata(slot_mapping=layout.slot_mapping, window=window,
                                 num_decodes=len(ctx), native=native_decodes is not None)
        if native_decodes is not None:
            meta.decode_block_ids, meta.decode_ctx_lens, meta.decode_max_blocks = native_decodes
        elif nd:
            lo = np.zeros_like(ctx) if window is None else np.maximum(ctx - window, 0)
            first = lo // bs
            count = (ctx + bs - 1) // bs - first
            max_blocks = int(count.max())
            j = np.arange(max_blocks)
            valid = j[None, :] < count[:, None]
            cols = np.where(valid, first[:, None] + j[None, :], 0)
            ids = np.where(valid, layout.block_table[rows[:, None], cols], 0)
            pos = (first * bs)[:, None] + np.arange(max_blocks * bs)[None, :]
            allowed = (pos >= lo[:, None]) & (pos < ctx[:, None])
            meta.decode_block_ids = torch.from_numpy(ids.reshape(-1)).to(dev)
            meta.decode_mask = self._mask(allowed).view(len(ctx), 1, 1, -1)
            meta.decode_max_blocks = max_blocks
        ends = np.cumsum(layout.q_lens)
        for i in range(nd, len(layout.slots)):
            nc, n, end = int(layout.num_computed[i]), int(layout.q_lens[i]), int(ends[i])
            span = PrefillSpan(start=end - n, end=end)
            q_pos = nc + np.arange(n)[:, None]
            if nc > 0:
                lo = 0 if window is None else max(0, nc - window + 1)
                first = lo // bs
                span.block_ids = torch.from_numpy(
                    layout.block_table[layout.slots[i], first:math.ceil((nc + n) / bs)].copy()
                ).to(dev)
                span.context_len = nc + n - first * bs
                k_pos = first * bs + np.arange(span.context_len)[None, :]
            elif window is not None and n > window:
                k_pos = np.arange(n)[None, :]
            else:
                meta.prefills.append(span)  # causal over its own K/V: no mask needed
                continue
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            span.mask = self._mask(allowed).view(1, 1, n, -1)
            meta.prefills.append(span)
        return meta


def decode_queries(layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
    """Each query token of the decode group: its block-table row and its context length. A
    request verifying k drafts puts k + 1 queries here, each attending exactly as the decode
    of that position would, so speculation changes no logit (not even its rounding)."""
    nd = layout.num_decodes
    q = layout.q_lens[:nd]
    rows = np.repeat(layout.slots[:nd], q)
    first = np.repeat(np.cumsum(q) - q, q)
    ctx = np.repeat(layout.num_computed[:nd], q) + (np.arange(len(rows)) - first) + 1
    return rows, ctx


def _gather(blocks: torch.Tensor, ids: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    if (buf is None or buf.shape[0] < ids.numel() or buf.shape[1] != blocks.shape[1]
            or buf.dtype != blocks.dtype):
        return blocks.index_select(0, ids)
    return torch.index_select(blocks, 0, ids, out=buf[:ids.numel()])


def _gather_kv(blocks: torch.Tensor, ids: torch.Tensor, buf: torch.Tensor | None,
               shape: tuple[int, int, int, int], head_dim: int, dtype: torch.dtype
               ) -> torch.Tensor:
    """The cache rows of blocks `ids` as values [*shape[:-1], head_dim] in `dtype`."""
    rows = _gather(blocks, ids, buf).view(shape)
    return rows if rows.dtype == dtype else dequantize_rows(rows, head_dim, dtype)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attend with query [T, H, D] -> [T, H * D], this step's key/value [T, KVH, D] already
    in the cache (the layer's `qkv_rope_store` wrote them). The result may be a view of
    `meta.out`, valid until the next layer runs."""
    k_cache, v_cache = kv_cache
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, row = k_cache.shape
    groups = num_heads // num_kv_heads
    k_blocks = k_cache.view(num_blocks, -1)
    v_blocks = v_cache.view(num_blocks, -1)
    out = meta.out if meta.out is not None else query.new_empty(num_tokens, num_heads * head_dim)

    nd = meta.num_decodes
    if nd and meta.native:
        if meta.decode_block_ids is None or meta.decode_ctx_lens is None or meta.scratch is None:
            raise ValueError("native decode metadata without its block table or scratch")
        paged_decode(query[:nd], k_cache, v_cache, meta.decode_block_ids, meta.decode_ctx_lens,
                     meta.window, scale, out[:nd], meta.scratch)
    elif nd:
        if meta.decode_block_ids is None or meta.decode_mask is None:
            raise ValueError("decode metadata without its block ids or mask")
        shape = (nd, meta.decode_max_blocks * block_size, num_kv_heads, row)
        # [nd, ctx, KVH, D] viewed as [nd, KVH, ctx, D]; SDPA accepts the strided view.
        k = _gather_kv(k_blocks, meta.decode_block_ids, meta.k_buf, shape, head_dim,
                       query.dtype)
        v = _gather_kv(v_blocks, meta.decode_block_ids, meta.v_buf, shape, head_dim,
                       query.dtype)
        q = query[:nd].view(nd, num_kv_heads, groups, head_dim)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=meta.decode_mask, scale=scale)
        if not meta.prefills:  # a pure decode step: no scatter into a shared output
            return o.reshape(num_tokens, num_heads * head_dim)
        out[:nd] = o.reshape(nd, num_heads * head_dim)

    for span in meta.prefills:
        q = query[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.block_ids is None:
            k = key[span.start:span.end]
            v = value[span.start:span.end]
        else:
            nb = span.block_ids.numel()
            shape = (1, nb * block_size, num_kv_heads, row)
            k = _gather_kv(k_blocks, span.block_ids, meta.k_buf, shape, head_dim,
                           query.dtype)[0, :span.context_len]
            v = _gather_kv(v_blocks, span.block_ids, meta.v_buf, shape, head_dim,
                           query.dtype)[0, :span.context_len]
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask, is_causal=span.mask is None and q.shape[2] > 1, scale=scale,
            enable_gqa=groups > 1)
        out[span.start:span.end] = o[0].transpose(0, 1).reshape(-1, num_heads * head_dim)
    return out
