"""Paged attention: plain torch, plus a native decode kernel for the CPU.

The KV cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim].
Each step writes the new keys/values through a flat slot mapping, then attends:

* decodes (one query token each) sit first in the flattened batch and are done in one padded
  batch: their blocks are gathered whole (a block is one contiguous row, so this is a single
  index_select), padding points at the null block 0 and is masked out. The query heads that
  share a KV head are folded into the query-length axis, so GQA needs no K/V repeat;
* on the CPU in float32 the decodes instead go to a small C kernel (`_NATIVE_SRC`, compiled
  with the system C compiler on first use and cached; the torch path above is the fallback).
  It reads each sequence's K/V rows straight from their blocks, once: the gather copy, the
  padded mask and SDPA's blocking for 3-row queries cost more than the attention itself;
* each prefill chunk is done on its own: with no cached prefix it attends to its fresh K/V with
  a plain causal mask; after a cached prefix it gathers its blocks and uses a bool mask that is
  full over the prefix and causal inside the chunk.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


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
        o = _native_decode(query[:nd], k_cache, v_cache, meta.decode_block_ids,
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


# ---------------------------------------------------------------- native decode kernel
# One call handles decodes [b0, b1). Per sequence: scores for every query head in one pass
# over its K rows (a token's row holds all KV heads, so blocks are read front to back), a
# softmax per head, then one pass over the V rows. Vector types keep the 64-wide dot products
# in registers; expf is declared with the vector ABI so the softmax loop calls glibc's
# libmvec (when linking it fails, the plain declaration from math.h is used).
_NATIVE_SRC = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef USE_MVEC
__attribute__((simd("notinbranch"))) float expf(float);
#endif
/* Blocks sit at random places, so the hardware prefetcher stalls at every block start:
   while a block's row i is used, row i of the sequence's next block is requested. */
#define PREFETCH_ROW(ptr) \
    for (int64_t j = 0; j < tok_stride; j += 16) __builtin_prefetch((ptr) + j)
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

#ifdef __clang__
#define SHUF(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUF(x, ...) __builtin_shuffle(x, (v16i){__VA_ARGS__})
#endif

static inline float hsum(v16 x) {
    x += SHUF(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUF(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUF(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUF(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

/* q [nd, kvh * groups, head_dim] (rows q_stride apart), caches [blocks, bs, kvh, head_dim],
   block_table [nd, max_blocks], out [nd, kvh * groups * head_dim]. head_dim % 16 == 0. */
int slotserve_paged_decode_f32(const float* q, int64_t q_stride, const float* k_cache,
        const float* v_cache, const int64_t* block_table, int64_t max_blocks,
        const int64_t* ctx_lens, float* out, int64_t b0, int64_t b1, int64_t kvh,
        int64_t groups, int64_t head_dim, int64_t bs, float scale) {
    int64_t max_ctx = max_blocks * bs, nh = kvh * groups, nc = head_dim / 16;
    int64_t tok_stride = kvh * head_dim, blk_stride = bs * tok_stride;
    float* p = malloc(sizeof(float) * nh * max_ctx);
    if (!p) return 1;
    for (int64_t b = b0; b < b1; b++) {
        int64_t n = ctx_lens[b];
        const int64_t* blocks = block_table + b * max_blocks;
        const float* qb = q + b * q_stride;
        for (int64_t t0 = 0; t0 < n; t0 += bs) {
            const float* blk = k_cache + blocks[t0 / bs] * blk_stride;
            const float* next = t0 + bs < n ? k_cache + blocks[t0 / bs + 1] * blk_stride : blk;
            int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t i = 0; i < tn; i++) {
                PREFETCH_ROW(next + i * tok_stride);
                for (int64_t hq = 0; hq < nh; hq++) {
                    const v16* kv = (const v16*)(blk + i * tok_stride + hq / groups * head_dim);
                    const v16* qv = (const v16*)(qb + hq * head_dim);
                    v16 acc = qv[0] * kv[0];
                    for (int64_t c = 1; c < nc; c++) acc += qv[c] * kv[c];
                    p[hq * max_ctx + t0 + i] = scale * hsum(acc);
                }
            }
        }
        for (int64_t hq = 0; hq < nh; hq++) {
            float* ph = p + hq * max_ctx;
            float m = ph[0], sum = 0.0f;
            for (int64_t t = 1; t < n; t++) m = ph[t] > m ? ph[t] : m;
#pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < n; t++) { ph[t] = expf(ph[t] - m); sum += ph[t]; }
            float inv = 1.0f / sum;
            for (int64_t t = 0; t < n; t++) ph[t] *= inv;
        }
        v16* acc = (v16*)(out + b * nh * head_dim);
        memset(acc, 0, sizeof(float) * nh * head_dim);
        for (int64_t t0 = 0; t0 < n; t0 += bs) {
            const float* blk = v_cache + blocks[t0 / bs] * blk_stride;
            const float* next = t0 + bs < n ? v_cache + blocks[t0 / bs + 1] * blk_stride : blk;
            int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t i = 0; i < tn; i++) {
                PREFETCH_ROW(next + i * tok_stride);
                for (int64_t hq = 0; hq < nh; hq++) {
                    const v16* vv = (const v16*)(blk + i * tok_stride + hq / groups * head_dim);
                    v16 w = (v16){0} + p[hq * max_ctx + t0 + i];
                    for (int64_t c = 0; c < nc; c++) acc[hq * nc + c] += w * vv[c];
                }
            }
        }
    }
    free(p);
    return 0;
}
"""
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
           "-shared", "-fPIC"]
# None: not tried yet; False: unavailable; else the ctypes function.
_native_fn: Callable[..., int] | bool | None = None
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (pid, workers): a pool inherited through fork() has no threads


def _cpu_flags() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_native() -> Callable[..., int] | None:
    if os.environ.get("SLOTSERVE_NATIVE_ATTENTION", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler found: decode attention uses the torch path")
        return None
    key = hashlib.sha256((_NATIVE_SRC + " ".join(_CFLAGS) + cc + _cpu_flags()).encode())
    cache = Path(os.environ.get("SLOTSERVE_CACHE_DIR")
                 or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve")
    lib_path = cache / f"paged_decode_{key.hexdigest()[:16]}.so"
    try:
        if not lib_path.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                src = Path(tmp) / "paged_decode.c"
                src.write_text(_NATIVE_SRC)
                out = Path(tmp) / "paged_decode.so"
                for extra in (["-DUSE_MVEC", "-lmvec", "-lm"], ["-lm"]):
                    res = subprocess.run([cc, *_CFLAGS, str(src), "-o", str(out), *extra],
                                         capture_output=True, text=True, timeout=120)
                    if res.returncode == 0:
                        break
                else:
                    logger.warning("native decode kernel did not compile (torch path used): "
                                   "%s", res.stderr[-2000:])
                    return None
                os.replace(out, lib_path)  # atomic: concurrent processes may race here
        fn = ctypes.CDLL(str(lib_path)).slotserve_paged_decode_f32
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native decode kernel unavailable (torch path used): %r", exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, p, p, i, p, p, i, i, i, i, i, i, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def native_decode_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether decodes of this model can use the native kernel (building it on first call)."""
    global _native_fn
    if dtype != torch.float32 or device.type != "cpu" or head_dim % 16:
        return False
    if _native_fn is None:
        _native_fn = _build_native() or False
    return _native_fn is not False


def _native_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_ids: torch.Tensor, max_blocks: int, ctx_lens: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """query [nd, H, D] (rows may be strided) -> [nd, H * D]; see `_NATIVE_SRC`."""
    global _pool, _pool_key
    nd, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    # The kernel trusts these; the runner builds them contiguous and int64.
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_ids.is_contiguous() and ctx_lens.is_contiguous()
    assert block_ids.dtype == torch.int64 and ctx_lens.dtype == torch.int64
    out = query.new_empty(nd, num_heads * head_dim)
    fn = _native_fn
    assert callable(fn)

    def run(b0: int, b1: int) -> None:
        rc = fn(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_ids.data_ptr(), max_blocks, ctx_lens.data_ptr(), out.data_ptr(), b0, b1,
                num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, scale)
        if rc != 0:
            raise MemoryError("native decode kernel could not allocate its scratch")

    threads = min(torch.get_num_threads(), nd)
    if threads <= 1:
        run(0, nd)
    else:
        # ctypes drops the GIL during the call, so sequence ranges run in parallel.
        if _pool is None or _pool_key[0] != os.getpid() or _pool_key[1] < threads:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="slotserve-attn")
            _pool_key = (os.getpid(), threads)
        bounds = [nd * j // threads for j in range(threads + 1)]
        list(_pool.map(run, bounds[:-1], bounds[1:]))
    return out
