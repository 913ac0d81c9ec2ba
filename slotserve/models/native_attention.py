"""Native CPU decode attention: a small C kernel that reads K/V straight from the paged blocks.

For decodes (one query token per sequence) on the CPU in float32 the torch path's gather copy,
padded mask and SDPA blocking for 3-row queries cost more than the attention itself, so this
kernel walks each sequence's blocks once instead. It is compiled with the system C compiler on
first use, cached under the slotserve cache directory (keyed by source, flags, compiler and
CPU), and loaded with ctypes. When there is no compiler, the build or load fails, or
`SLOTSERVE_NATIVE_ATTENTION=0` is set, `native_decode_supported` says no and the caller uses
the torch path; a failure is logged once per process.

The environment switch is read on every `native_decode_supported` call (one per ModelRunner),
so tests can flip it with `monkeypatch.setenv`; only the built library is cached.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "SLOTSERVE_NATIVE_ATTENTION"

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
# Tried in order: the vectorized expf from libmvec, then plain libm.
_LINK_VARIANTS = (["-DUSE_MVEC", "-lmvec", "-lm"], ["-lm"])
_COMPILE_TIMEOUT_S = 120

# None: not tried yet; False: unavailable (already logged); else the ctypes function.
_native_fn: Callable[..., int] | bool | None = None
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (pid, workers): a pool inherited through fork() has no threads


class NativeBuildError(RuntimeError):
    """The C compiler rejected the kernel with every link variant."""


def find_compiler() -> str | None:
    """The C compiler the kernel is built with: $CC, else gcc, else cc."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    return Path(os.environ.get("SLOTSERVE_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve")


def _cpu_flags() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(cc: str, cache: Path) -> Path:
    key = hashlib.sha256((_NATIVE_SRC + " ".join(_CFLAGS) + cc + _cpu_flags()).encode())
    return cache / f"paged_decode_{key.hexdigest()[:16]}.so"


@contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """Serialize builds into one cache dir across processes (pytest-xdist, server + tests).

    Only saves duplicate compiles: correctness comes from the atomic rename, so where flock
    is missing or refused (some network filesystems) the build goes ahead unlocked.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(cache / ".build.lock", "a") as f:
        with suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def compile_library(cc: str, cache: Path) -> Path:
    """Build the kernel into `cache` unless it is there already; returns the library's path.

    Raises NativeBuildError when it does not compile, OSError / SubprocessError otherwise.
    """
    lib = library_path(cc, cache)
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache):
        if lib.is_file():  # another process built it while this one waited for the lock
            return lib
        # Compile inside a private temp dir on the same filesystem, then rename: a process
        # loading `lib` concurrently sees either no file or the whole file, never a partial one.
        with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
            src = Path(tmp) / "paged_decode.c"
            src.write_text(_NATIVE_SRC)
            out = Path(tmp) / "paged_decode.so"
            errors = ""
            for extra in _LINK_VARIANTS:
                res = subprocess.run([cc, *_CFLAGS, str(src), "-o", str(out), *extra],
                                     capture_output=True, text=True,
                                     timeout=_COMPILE_TIMEOUT_S)
                if res.returncode == 0:
                    break
                errors = res.stderr
            else:
                raise NativeBuildError(errors[-2000:])
            os.replace(out, lib)
    return lib


def _load(lib: Path) -> Callable[..., int]:
    fn = ctypes.CDLL(str(lib)).slotserve_paged_decode_f32
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, p, p, i, p, p, i, i, i, i, i, i, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def _build_native() -> Callable[..., int] | None:
    """Compile (or reuse) and load the kernel; None, after logging why, when that fails."""
    cc = find_compiler()
    if cc is None:
        logger.info("no C compiler found: decode attention uses the torch path")
        return None
    cache = cache_dir()
    try:
        lib = compile_library(cc, cache)
        try:
            return _load(lib)
        except OSError:
            # A damaged cached file (e.g. written by a process killed mid-copy before builds
            # were atomic, or a full disk): rebuild it once.
            lib.unlink(missing_ok=True)
            return _load(compile_library(cc, cache))
    except NativeBuildError as exc:
        logger.warning("native decode kernel did not compile (torch path used): %s", exc)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native decode kernel unavailable (torch path used): %r", exc)
    return None


def native_enabled() -> bool:
    """False when SLOTSERVE_NATIVE_ATTENTION=0 asks for the torch path."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def native_decode_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether decodes of this model can use the native kernel (building it on first call)."""
    global _native_fn
    if not native_enabled() or dtype != torch.float32 or device.type != "cpu" or head_dim % 16:
        return False
    if _native_fn is None:
        _native_fn = _build_native() or False  # a failure is cached, so it is logged once
    return _native_fn is not False


def native_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_ids: torch.Tensor, max_blocks: int, ctx_lens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """query [nd, H, D] (rows may be strided) -> [nd, H * D]; see `_NATIVE_SRC`.

    block_ids is read as [nd, max_blocks], ctx_lens as [nd]; both int64 and unchecked, so the
    caller guarantees ids < num_blocks. Requires native_decode_supported(...) to be True.
    """
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
    assert callable(fn), "native_decode called before native_decode_supported succeeded"

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
