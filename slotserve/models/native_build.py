"""Building the native CPU kernels (`models/csrc/*.c`) with the system C compiler on first use.

Each kernel ships as C source (package data). `compile_library` compiles it into the slotserve
cache directory (`$SLOTSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/slotserve`), keyed by source,
flags, compiler and CPU level; builds are locked across processes and atomic (a process
loading the library concurrently sees either no file or the whole file). `load_kernel` builds
or reuses the library and returns it loaded, or None after logging why once; callers keep a
torch path for that case.

CPU levels: every kernel is built for one x86-64 level (`CPU_LEVELS`: v4 = AVX-512, with or
without VNNI; v3 = AVX2 + FMA + F16C, with or without AVX-VNNI; v2 = the portable C paths),
chosen at run time as the best one /proc/cpuinfo's flags allow, so one cache folder serves
any CPU and the code that runs is the code the tests built for that level. A kernel's own
`-march` is replaced by its level's flags. `SLOTSERVE_CPU_LEVEL=<name>` forces a lower level
(benchmarks of the AVX2 code on an AVX-512 machine); that, $CC and the cache dir are all the
environment the kernels read.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from slotserve.config import cache_root
from slotserve.errors import ConfigError

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


@dataclass(frozen=True, slots=True)
class CpuLevel:
    """An instruction-set level the kernels are built for: gcc flags, and the /proc/cpuinfo
    flags a CPU needs to run the result."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]
    what: str  # for log lines


_V2 = frozenset({"cx16", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first. The portable level has no x86 flags: it is the only one off x86-64.
CPU_LEVELS: tuple[CpuLevel, ...] = (
    CpuLevel("v4-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"},
             "AVX-512 with VNNI"),
    CpuLevel("v4", ("-march=x86-64-v4",), _V4, "AVX-512"),
    CpuLevel("v3-vnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"},
             "AVX2 with AVX-VNNI"),
    CpuLevel("v3", ("-march=x86-64-v3",), _V3, "AVX2"),
    CpuLevel("v2", ("-march=x86-64-v2",), _V2, "portable C (x86-64-v2)"),
)
PORTABLE = CpuLevel("portable", (), frozenset(), "portable C")
_LEVEL_ENV = "SLOTSERVE_CPU_LEVEL"


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...), "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def supported_levels() -> list[CpuLevel]:
    """The levels this CPU runs, best first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [PORTABLE]
    flags = _cpu_flags()
    return [lv for lv in CPU_LEVELS if lv.needs <= flags] or [PORTABLE]


def cpu_level() -> CpuLevel:
    """The level kernels are built for here: the best supported, or $SLOTSERVE_CPU_LEVEL."""
    levels = supported_levels()
    forced = os.environ.get(_LEVEL_ENV)
    if not forced:
        return levels[0]
    for lv in levels:
        if lv.name == forced:
            return lv
    known = ", ".join(lv.name for lv in (*CPU_LEVELS, PORTABLE))
    raise ConfigError(f"{_LEVEL_ENV}={forced!r} is not a level this CPU runs (it runs "
                      f"{', '.join(lv.name for lv in levels)}; levels: {known})")


class NativeKernelError(ValueError):
    """A kernel was called with arguments it cannot use (nothing was read out of bounds)."""


class NativeBuildError(RuntimeError):
    """The C compiler rejected the kernel with every link variant."""


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else gcc, else cc."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    """Built kernels live in the project's one cache folder (config.cache_root)."""
    return cache_root()


def build_flags(kernel: KernelSource, level: CpuLevel) -> list[str]:
    return [*(f for f in kernel.cflags if not f.startswith("-march=")), *level.cflags]


def library_path(kernel: KernelSource, cc: str, cache: Path, level: CpuLevel) -> Path:
    # The headers beside the source are part of what gets compiled (they include each other
    # by name), so they are part of the key too.
    headers = sorted(kernel.source.parent.glob("*.h"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [kernel.source, *headers])
                         + " ".join([*build_flags(kernel, level), cc]).encode())
    return cache / f"{kernel.name}_{level.name}_{key.hexdigest()[:16]}.so"


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


def compile_library(kernel: KernelSource, cc: str, cache: Path,
                    level: CpuLevel | None = None) -> Path:
    """Build the kernel for `level` (default: cpu_level()) into `cache` unless it is there
    already; returns the library's path.

    Raises NativeBuildError when it does not compile, OSError / SubprocessError otherwise.
    """
    level = cpu_level() if level is None else level
    lib = library_path(kernel, cc, cache, level)
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
                res = subprocess.run([cc, *build_flags(kernel, level), str(kernel.source),
                                      "-o", str(out), *extra], capture_output=True, text=True,
                                     timeout=_COMPILE_TIMEOUT_S)
                if res.returncode == 0:
                    break
                errors = res.stderr
            else:
                raise NativeBuildError(errors[-2000:])
            os.replace(out, lib)
    return lib


def load_kernel(kernel: KernelSource, what: str,
                level: CpuLevel | None = None) -> ctypes.CDLL | None:
    """Compile (or reuse) and load the kernel for `level` (default: cpu_level(), logged);
    None, after logging why, when that fails. `what` completes the log line: "<kernel>
    unavailable (<what>)"."""
    cc = find_compiler()
    if cc is None:
        logger.info("no C compiler found: %s unavailable (%s)", kernel.name, what)
        return None
    cache = cache_dir()
    if level is None:
        level = cpu_level()
        logger.info("native kernel %s: built for %s (%s)", kernel.name, level.name, level.what)
    try:
        lib = compile_library(kernel, cc, cache, level)
        try:
            return ctypes.CDLL(str(lib))
        except OSError:
            # A damaged cached file (a process killed mid-copy before builds were atomic, a
            # full disk): rebuild it once.
            lib.unlink(missing_ok=True)
            return ctypes.CDLL(str(compile_library(kernel, cc, cache, level)))
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
