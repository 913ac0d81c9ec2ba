"""Building the native CPU kernels (`models/csrc/*.c`) with the system C compiler on first use.

Each kernel ships as C source (package data). `compile_library` compiles it into the slotserve
cache directory (`$SLOTSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/slotserve`), keyed by source,
flags, compiler and CPU flags; builds are locked across processes and atomic (a process
loading the library concurrently sees either no file or the whole file). `load_kernel` builds
or reuses the library and returns it loaded, or None after logging why once; callers keep a
torch path for that case. Kernels never read the environment beyond $CC and the cache dir.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from slotserve.config import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
_COMPILE_TIMEOUT_S = 120
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (pid, workers): a pool inherited through fork() has no threads


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One C file and how to build it: `link_variants` are tried in order."""

    name: str  # the library's file stem, and the kernel's name in log lines
    source: Path
    cflags: tuple[str, ...]
    link_variants: tuple[tuple[str, ...], ...] = ((),)


class NativeBuildError(RuntimeError):
    """The C compiler rejected the kernel with every link variant."""


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else gcc, else cc."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    """Built kernels live in the project's one cache folder (config.cache_root)."""
    return cache_root()


def _cpu_flags() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(kernel: KernelSource, cc: str, cache: Path) -> Path:
    # The headers beside the source are part of what gets compiled (they include each other
    # by name), so they are part of the key too.
    headers = sorted(kernel.source.parent.glob("*.h"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [kernel.source, *headers])
                         + " ".join([*kernel.cflags, cc, _cpu_flags()]).encode())
    return cache / f"{kernel.name}_{key.hexdigest()[:16]}.so"


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


def compile_library(kernel: KernelSource, cc: str, cache: Path) -> Path:
    """Build the kernel into `cache` unless it is there already; returns the library's path.

    Raises NativeBuildError when it does not compile, OSError / SubprocessError otherwise.
    """
    lib = library_path(kernel, cc, cache)
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache):
        if lib.is_file():  # another process built it while this one waited for the lock
            return lib
        # Compile inside a private temp dir on the same filesystem, then rename.
        with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
            out = Path(tmp) / f"{kernel.name}.so"
            errors = ""
            for extra in kernel.link_variants:
                res = subprocess.run([cc, *kernel.cflags, str(kernel.source), "-o", str(out),
                                      *extra], capture_output=True, text=True,
                                     timeout=_COMPILE_TIMEOUT_S)
                if res.returncode == 0:
                    break
                errors = res.stderr
            else:
                raise NativeBuildError(errors[-2000:])
            os.replace(out, lib)
    return lib


def load_kernel(kernel: KernelSource, what: str) -> ctypes.CDLL | None:
    """Compile (or reuse) and load the kernel; None, after logging why, when that fails.
    `what` completes the log line: "<kernel> unavailable (<what>)"."""
    cc = find_compiler()
    if cc is None:
        logger.info("no C compiler found: %s unavailable (%s)", kernel.name, what)
        return None
    cache = cache_dir()
    try:
        lib = compile_library(kernel, cc, cache)
        try:
            return ctypes.CDLL(str(lib))
        except OSError:
            # A damaged cached file (a process killed mid-copy before builds were atomic, a
            # full disk): rebuild it once.
            lib.unlink(missing_ok=True)
            return ctypes.CDLL(str(compile_library(kernel, cc, cache)))
    except NativeBuildError as exc:
        logger.warning("native kernel %s did not compile (%s): %s", kernel.name, what, exc)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native kernel %s unavailable (%s): %r", kernel.name, what, exc)
    return None


def kernel_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least `threads` workers for kernel calls split into ranges
    (ctypes drops the GIL during a call, so the ranges run in parallel)."""
    global _pool, _pool_key
    if _pool is None or _pool_key[0] != os.getpid() or _pool_key[1] < threads:
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="slotserve-kernel")
        _pool_key = (os.getpid(), threads)
    return _pool
