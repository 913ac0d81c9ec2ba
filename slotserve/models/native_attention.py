"""Native CPU decode attention: a small C kernel that reads K/V straight from the paged blocks.

For decodes (one query token per sequence) on the CPU in float32 the torch path's gather copy,
padded mask and SDPA blocking for 3-row queries cost more than the attention itself, so this
kernel (`csrc/paged_decode.c`, shipped with the package) walks each sequence's blocks once
instead, and skips the blocks before a sliding window. It is compiled with the system C
compiler on first use, cached under the slotserve cache directory (keyed by source, flags,
compiler and CPU), and loaded with ctypes. When there is no compiler or the build or load
fails, `native_decode_supported` says no and the attention layer uses the torch path; a failure
is logged once per process. Whether to try it at all is the caller's argument
(`EngineArgs.native_attention`), not read from the environment here.

`paged_decode` checks every argument for real (shapes, strides, dtypes, devices; the kernel
itself checks context lengths and block ids against the cache before reading) and raises
`NativeKernelError`; it allocates nothing: the caller owns the output and the score scratch.
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

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.c"
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
           "-shared", "-fPIC"]
# Tried in order: the vectorized expf from libmvec, then plain libm.
_LINK_VARIANTS = (["-DUSE_MVEC", "-lmvec", "-lm"], ["-lm"])
_COMPILE_TIMEOUT_S = 120
# The kernel's return codes (the enum at the top of paged_decode.c).
_ERRORS = {1: "a context length is < 1 or longer than its block-table row",
           2: "a block id is outside the KV cache",
           3: "the scratch buffer is too small for the attended tokens"}

KernelFn = Callable[..., int]
# None: not tried yet; False: unavailable (already logged); else the ctypes function.
_native_fn: KernelFn | bool | None = None
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (pid, workers): a pool inherited through fork() has no threads


class NativeBuildError(RuntimeError):
    """The C compiler rejected the kernel with every link variant."""


class NativeKernelError(ValueError):
    """The kernel was called with arguments it cannot use (nothing was read out of bounds)."""


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
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_CFLAGS + [cc, _cpu_flags()]).encode())
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
            out = Path(tmp) / "paged_decode.so"
            errors = ""
            for extra in _LINK_VARIANTS:
                res = subprocess.run([cc, *_CFLAGS, str(SOURCE), "-o", str(out), *extra],
                                     capture_output=True, text=True,
                                     timeout=_COMPILE_TIMEOUT_S)
                if res.returncode == 0:
                    break
                errors = res.stderr
            else:
                raise NativeBuildError(errors[-2000:])
            os.replace(out, lib)
    return lib


def _load(lib: Path) -> KernelFn:
    fn = ctypes.CDLL(str(lib)).slotserve_paged_decode_f32
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, p, i, p, i, p, i, p, i, p, i, i, i, i, i, i, i, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def _build_native() -> KernelFn | None:
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


def native_decode_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether decodes of this model can use the native kernel (building it on first call)."""
    global _native_fn
    if dtype != torch.float32 or device.type != "cpu" or head_dim % 16:
        return False
    if _native_fn is None:
        _native_fn = _build_native() or False  # a failure is cached, so it is logged once
    return _native_fn is not False


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(f"native paged decode: {what}")


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, ctx_lens: torch.Tensor, window: int | None,
                 scale: float, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Attention of nd single-token queries over their paged contexts, written into `out`.

    query [nd, H, D] (rows may be strided, heads contiguous); caches [num_blocks, block_size,
    KVH, D] contiguous; block_table [nd, max_blocks] and ctx_lens [nd] int64 contiguous;
    out [nd, H * D] (rows may be strided); scratch [threads, n] float32 contiguous, where n is
    at least H * the most tokens one sequence attends to. `window` None or 0: the whole
    context. Requires native_decode_supported(...) to have returned True.
    """
    global _pool, _pool_key
    fn = _native_fn
    if not callable(fn):
        raise NativeKernelError("native paged decode: called before native_decode_supported() "
                                "built the kernel")
    _check(query.dim() == 3 and k_cache.dim() == 4 and block_table.dim() == 2
           and ctx_lens.dim() == 1 and out.dim() == 2 and scratch.dim() == 2, "bad ranks")
    nd, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _check(all(t.dtype == torch.float32 and t.device.type == "cpu"
               for t in (query, k_cache, v_cache, out, scratch)),
           "query, caches, out and scratch must be float32 CPU tensors")
    _check(block_table.dtype == ctx_lens.dtype == torch.int64
           and block_table.device.type == ctx_lens.device.type == "cpu",
           "block_table and ctx_lens must be int64 CPU tensors")
    _check(v_cache.shape == k_cache.shape and k_cache.is_contiguous()
           and v_cache.is_contiguous(), "K and V caches must be contiguous and alike")
    _check(head_dim == cache_head_dim and head_dim % 16 == 0 and num_heads % num_kv_heads == 0,
           f"query {tuple(query.shape)} does not fit the cache {tuple(k_cache.shape)} "
           "(head_dim a multiple of 16, heads a multiple of KV heads)")
    _check(query.stride(2) == 1 and query.stride(1) == head_dim, "query heads not contiguous")
    _check(block_table.shape[0] == nd and block_table.is_contiguous()
           and tuple(ctx_lens.shape) == (nd,) and ctx_lens.is_contiguous(),
           "block_table must be [nd, max_blocks] and ctx_lens [nd], contiguous")
    _check(tuple(out.shape) == (nd, num_heads * head_dim) and out.stride(1) == 1,
           f"out must be [{nd}, {num_heads * head_dim}] with contiguous rows")
    _check(scratch.is_contiguous() and scratch.shape[0] >= 1, "scratch must be contiguous")
    _check(window is None or window >= 0, "window must be None or >= 0")
    max_blocks, per_thread = block_table.shape[1], scratch.shape[1]

    def run(part: int, b0: int, b1: int) -> None:
        rc = fn(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                num_blocks, block_table.data_ptr(), max_blocks, ctx_lens.data_ptr(),
                window or 0, out.data_ptr(), out.stride(0),
                scratch.data_ptr() + part * per_thread * 4, per_thread, b0, b1, num_kv_heads,
                num_heads // num_kv_heads, head_dim, block_size, scale)
        if rc != 0:
            raise NativeKernelError(f"native paged decode: {_ERRORS.get(rc, f'error {rc}')}")

    threads = min(torch.get_num_threads(), nd, scratch.shape[0])
    if threads <= 1:
        run(0, 0, nd)
        return
    # ctypes drops the GIL during the call, so sequence ranges run in parallel.
    if _pool is None or _pool_key[0] != os.getpid() or _pool_key[1] < threads:
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="slotserve-attn")
        _pool_key = (os.getpid(), threads)
    bounds = [nd * j // threads for j in range(threads + 1)]
    list(_pool.map(run, range(threads), bounds[:-1], bounds[1:]))
