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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
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
