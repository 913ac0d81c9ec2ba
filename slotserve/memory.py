"""Process memory: what is resident, and handing freed heap back to the system.

Loading a large-vocabulary tokenizer or a checkpoint frees hundreds of MB of transient
allocations (Gemma 3's 262k-token tokenizer.json: about 190 MB of parsed JSON) that glibc keeps
in its heap; `trim_heap()` returns them (`malloc_trim(0)`), a no-op where the C library has no
such call. No torch here: both halves of the engine use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS) or no libc found
        return None
    return fn


def trim_heap() -> None:
    """Give the heap's free memory back to the operating system (glibc only)."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default); 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
