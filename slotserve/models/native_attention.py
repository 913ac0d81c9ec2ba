"""Native CPU decode attention: a small C kernel that reads K/V straight from the paged blocks.

For decodes (one query token per sequence) on the CPU with float32 queries (the cache in any
`--kv-cache-dtype`) the torch path's gather copy,
padded mask and SDPA blocking for 3-row queries cost more than the attention itself, so this
kernel (`csrc/paged_decode.c`, shipped with the package) walks each sequence's blocks once
instead, and skips the blocks before a sliding window. It is compiled with the system C
compiler on first use (`native_build`: cached under the slotserve cache directory, keyed by
source, flags, compiler and CPU) and loaded with ctypes. When there is no compiler or the build or load
fails, `native_decode_supported` says no and the attention layer uses the torch path; a failure
is logged once per process. Whether to try it at all is the caller's argument
(`EngineArgs.native_attention`), not read from the environment here.

`paged_decode` checks every argument for real (shapes, strides, dtypes, devices; the kernel
itself checks context lengths and block ids against the cache before reading) and raises
`NativeKernelError`; it allocates nothing: the caller owns the output and the score scratch.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from slotserve.models import native_build, paged_decode_lib
from slotserve.models.kv_storage import KV_CODES, row_elems
from slotserve.models.native_build import (
    NativeBuildError,
    NativeKernelError,
    cache_dir,
    find_compiler,
    kernel_pool,
)

__all__ = ["NativeBuildError", "NativeKernelError", "cache_dir", "compile_library",
           "find_compiler", "native_decode_supported", "paged_decode"]

logger = logging.getLogger(__name__)

SOURCE = paged_decode_lib.SOURCE
KERNEL = paged_decode_lib.KERNEL
# The kernel's return codes (the enum at the top of paged_decode.c).
_ERRORS = {1: "a context length is < 1 or longer than its block-table row",
           2: "a block id is outside the KV cache",
           3: "the scratch buffer is too small for the attended tokens",
           4: "the KV cache's storage type is unknown to the kernel"}

KernelFn = paged_decode_lib.KernelFn
# None: not tried yet; False: unavailable (already logged); else the ctypes function.
_native_fn: KernelFn | bool | None = None


def compile_library(cc: str, cache: Path) -> Path:
    """Build the decode kernel into `cache` (native_build.compile_library)."""
    return native_build.compile_library(KERNEL, cc, cache)


def _load(lib: Path | ctypes.CDLL) -> KernelFn:
    return paged_decode_lib.bind(lib)


def _build_native() -> KernelFn | None:
    """The kernel, built and loaded on the first call; None, after logging why, when that
    fails."""
    return paged_decode_lib.load()


def native_decode_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether decodes of this model can use the native kernel (building it on first call)."""
    global _native_fn
    if dtype != torch.float32 or device.type != "cpu" or head_dim % 16:  # the query's dtype
        return False
    if _native_fn is None:
        _native_fn = _build_native() or False  # a failure is cached, so it is logged once
    return _native_fn is not False


def _fail(what: str) -> NativeKernelError:
    return NativeKernelError(f"native paged decode: {what}")


_F32, _I64 = torch.float32, torch.int64


def _why_not(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_table: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
             out: torch.Tensor, scratch: torch.Tensor) -> str | None:
    """What is wrong with the arguments, or None. Called every layer of every step, so it is
    plain comparisons in a chain that stops at the first failure; messages are built only
    then."""
    if query.dim() != 3 or k_cache.dim() != 4 or block_table.dim() != 2 \
            or ctx_lens.dim() != 1 or out.dim() != 2 or scratch.dim() != 2:
        return "bad ranks"
    nd, num_heads, head_dim = query.shape
    _, _, num_kv_heads, row = k_cache.shape
    if query.dtype != _F32 or out.dtype != _F32 or scratch.dtype != _F32 \
            or not (query.is_cpu and out.is_cpu and scratch.is_cpu):
        return "query, out and scratch must be float32 CPU tensors"
    if k_cache.dtype not in KV_CODES or v_cache.dtype != k_cache.dtype \
            or not (k_cache.is_cpu and v_cache.is_cpu):
        return ("the caches must be CPU tensors of one storage type: float32, bfloat16, "
                "float16, int8")
    if block_table.dtype != _I64 or ctx_lens.dtype != _I64 \
            or not (block_table.is_cpu and ctx_lens.is_cpu):
        return "block_table and ctx_lens must be int64 CPU tensors"
    if v_cache.shape != k_cache.shape or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        return "K and V caches must be contiguous and alike"
    if row != row_elems(head_dim, k_cache.dtype) or head_dim % 16 or num_heads % num_kv_heads:
        return (f"query {tuple(query.shape)} does not fit the cache {tuple(k_cache.shape)} "
                "(head_dim a multiple of 16, heads a multiple of KV heads)")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        return "query heads not contiguous"
    if block_table.shape[0] != nd or not block_table.is_contiguous() \
            or ctx_lens.shape[0] != nd or not ctx_lens.is_contiguous():
        return "block_table must be [nd, max_blocks] and ctx_lens [nd], contiguous"
    if out.shape[0] != nd or out.shape[1] != num_heads * head_dim or out.stride(1) != 1:
        return f"out must be [{nd}, {num_heads * head_dim}] with contiguous rows"
    if not scratch.is_contiguous() or scratch.shape[0] < 1:
        return "scratch must be contiguous"
    if window is not None and window < 0:
        return "window must be None or >= 0"
    return None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
                 scale: float, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Attention of nd single-token queries over their paged contexts, written into `out`.

    query [nd, H, D] float32 (rows may be strided, heads contiguous); caches [num_blocks,
    block_size, KVH, row] contiguous, rows as models/kv_storage.py stores them (row_elems:
    D values, int8 ones followed by their block scales); block_table [nd, max_blocks] and
    ctx_lens [nd] int64 contiguous;
    out [nd, H * D] (rows may be strided); scratch [threads, n] float32 contiguous, where n is
    at least H * the most tokens one sequence attends to. `window` None or 0: the whole
    context. Requires native_decode_supported(...) to have returned True.
    """
    fn = _native_fn
    if not callable(fn):
        raise NativeKernelError("native paged decode: called before native_decode_supported() "
                                "built the kernel")
    problem = _why_not(query, k_cache, v_cache, block_table, ctx_lens, window, out, scratch)
    if problem is not None:
        raise _fail(problem)
    nd, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, row = k_cache.shape
    max_blocks, per_thread = block_table.shape[1], scratch.shape[1]

    def run(part: int, b0: int, b1: int) -> None:
        rc = fn(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                num_blocks, block_table.data_ptr(), max_blocks, ctx_lens.data_ptr(),
                window or 0, out.data_ptr(), out.stride(0),
                scratch.data_ptr() + part * per_thread * 4, per_thread, b0, b1, num_kv_heads,
                num_heads // num_kv_heads, head_dim, block_size, scale,
                row * k_cache.element_size(), KV_CODES[k_cache.dtype])
        if rc != 0:
            raise NativeKernelError(f"native paged decode: {_ERRORS.get(rc, f'error {rc}')}")

    threads = min(torch.get_num_threads(), nd, scratch.shape[0])
    if threads <= 1:
        run(0, 0, nd)
        return
    # ctypes drops the GIL during the call, so sequence ranges run in parallel.
    bounds = [nd * j // threads for j in range(threads + 1)]
    list(kernel_pool(threads).map(run, range(threads), bounds[:-1], bounds[1:]))
