"""Process memory: what is resident, handing freed heap back to the system once, and keeping
the step's buffers in the heap afterwards.

Loading a large-vocabulary tokenizer or a checkpoint frees hundreds of MB of transient
allocations (Gemma 3's 262k-token tokenizer.json: about 190 MB of parsed JSON) that glibc keeps
in its heap; `trim_heap()` returns them (`malloc_trim(0)`).

During steps the opposite is wanted: glibc serves every allocation above its mmap threshold
(at most 32 MB by default) with fresh pages and unmaps them on free, so a prefill chunk's
activations (tens of MB per layer) are page-faulted and zeroed by the kernel again on every
call. `keep_freed_memory()` raises the threshold so that they are reused from the heap: resident
memory stays at the high-water mark of one step instead. Both are no-ops where the C library is
not glibc. No torch here: both halves of the engine use it.

Importing a large native library faults in far more of its code than serving runs: `import
torch` leaves 90-125 MB of libtorch_cpu.so resident (its operator registrations run once),
of which a decode step uses a few MB. `page_out_libraries()` asks the kernel to drop the
shared libraries' pages from this process once startup is over (Linux 5.4+ MADV_PAGEOUT);
what the steps use is faulted back in by the first request and stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MADV_PAGEOUT = 21  # linux/mman.h (5.4+)
# SLOTSERVE_PAGE_OUT_LIBRARIES=0 keeps startup's library pages resident.
PAGE_OUT_ENV = "SLOTSERVE_PAGE_OUT_LIBRARIES"

logger = logging.getLogger(__name__)
# Allocations up to this size come from the heap once keep_freed_memory() ran: every
# activation of a 2048-token prefill chunk is smaller.
KEEP_BELOW_BYTES = 256 << 20


@functools.cache
def _libc_fn(name: str) -> Callable[..., int] | None:
    try:
        fn: Callable[..., int] = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS) or no libc found
        return None
    return fn


def trim_heap() -> None:
    """Give the heap's free memory back to the operating system (glibc only)."""
    fn = _libc_fn("malloc_trim")
    if fn is not None:
        fn(0)


def keep_freed_memory() -> None:
    """From now on, keep freed blocks below KEEP_BELOW_BYTES in the heap for reuse instead of
    unmapping them (glibc only). Call it after the large one-time allocations (the weights,
    the KV cache, which must stay lazily resident)."""
    fn = _libc_fn("mallopt")
    if fn is not None:
        fn(_M_MMAP_THRESHOLD, KEEP_BELOW_BYTES)
        fn(_M_TRIM_THRESHOLD, KEEP_BELOW_BYTES)


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default); 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _library_span(fields: list[str]) -> tuple[int, int] | None:
    """(start, length) when a maps / smaps header line (split in at most 6) is a read-only
    mapping of a shared object: its code and constants. Writable ones (relocated data, .bss)
    are anonymous once touched and stay."""
    if len(fields) < 6 or "w" in fields[1] or not fields[5].startswith("/"):
        return None
    name = os.path.basename(fields[5].rstrip())
    if not (name.endswith(".so") or ".so." in name):
        return None
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    return lo, hi - lo


def _library_mappings() -> list[tuple[int, int]]:
    try:
        with open("/proc/self/maps") as f:
            return [span for line in f if (span := _library_span(line.split(maxsplit=5)))]
    except OSError:
        return []


def library_resident_bytes(pid: int | None = None, name: str | None = None) -> int:
    """Resident bytes of a process's read-only shared-object mappings (/proc/PID/smaps); of
    the library file `name` (e.g. "libtorch_cpu.so") alone when given."""
    total, counting = 0, False
    try:
        with open(f"/proc/{pid or 'self'}/smaps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if "-" in fields[0]:  # a mapping's header: "start-end perms offset dev inode [path]"
                    counting = _library_span(fields) is not None and (
                        name is None or fields[5].rstrip().endswith("/" + name))
                elif counting and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def page_out_libraries() -> int:
    """Drop the resident pages of every shared library mapped read-only (Linux only).

    Call it once startup is over: what ran only then (import-time registrations, the loader)
    is not read again. Pages a later step needs come back as page faults, once; pages another
    process maps too are left alone by the kernel. Returns the bytes dropped: 0 where
    MADV_PAGEOUT is missing (before Linux 5.4) or SLOTSERVE_PAGE_OUT_LIBRARIES=0."""
    if os.environ.get(PAGE_OUT_ENV, "1") == "0":
        return 0
    fn = _libc_fn("madvise")
    spans = _library_mappings()
    if fn is None or not spans:
        return 0
    before = library_resident_bytes()
    for start, length in spans:  # each refused (EINVAL) by a kernel before 5.4
        fn(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_PAGEOUT)
    dropped = max(0, before - library_resident_bytes())
    logger.info("library pages only startup used dropped: %.0f MiB", dropped / 2**20)
    return dropped
