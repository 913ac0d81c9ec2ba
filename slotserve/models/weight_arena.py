"""Memory for repacked weights, backed by transparent huge pages (2 MiB) where Linux has them.

A decode step streams every weight from DRAM once (the 262k x 640 Q8_0 output projection of
Gemma 3 270M is 178 MB). On 4 KiB pages that is one TLB miss, and a page walk, per 4 KiB
read, and the hardware prefetcher stops at each page: measured on the AMD EPYC here
(`benchmarks/decode_step_profile.py --gemma --batch 1`, same run, 3 alternations), the output
projection took 6.5-8.0 ms on 4 KiB pages and 5.7-5.8 ms on 2 MiB ones (31 GB/s: the read
bandwidth of one core).

Weights are carved from chunks of anonymous memory (64 MiB, or one weight's size when larger)
aligned to 2 MiB and advised MADV_HUGEPAGE before their first write, so their pages are huge
from the first fault (with THP in `madvise` or `always` mode). Small weights share chunks, so
they are covered too, with no padding per weight. Only the written part of a chunk becomes
resident (at most one huge page more). A chunk is freed when the last weight in it is; the
arena keeps only a weak reference to the chunk it is filling.

`SLOTSERVE_HUGE_PAGES=0` allocates plain memory instead (A/B runs); so does a system without
THP or without `madvise`. Torch-free: the arena hands out numpy arrays (`weight_array`), the
torch modules view them as tensors (`weight_buffer`).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN = 64  # every weight starts on a cache line
HUGE_PAGES_ENV = "SLOTSERVE_HUGE_PAGES"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def huge_pages_available() -> bool:
    """Whether weights go to huge-page chunks here (Linux with THP not `never`, unless
    SLOTSERVE_HUGE_PAGES=0)."""
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class WeightArena:
    """Bump allocation of uint8 arrays from huge-page chunks."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: weakref.ref[mmap.mmap] | None = None
        self._offset = self._end = 0
        self._lock = threading.Lock()

    def empty(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """An uninitialized uint8 array of `nbytes` (at least 1) on huge pages."""
        nbytes = max(1, nbytes)
        with self._lock:
            chunk = self._chunk() if self._chunk is not None else None
            if chunk is None or self._offset + nbytes > self._end:
                chunk = self._new_chunk(nbytes)
            out = np.frombuffer(chunk, dtype=np.uint8, count=nbytes, offset=self._offset)
            self._offset = _round_up(self._offset + nbytes, ALIGN)
        return out

    def _new_chunk(self, nbytes: int) -> mmap.mmap:
        size = max(self.chunk_bytes, _round_up(nbytes, HUGE_PAGE)) + HUGE_PAGE
        # Private: an anonymous shared map is shmem, whose huge pages are a separate setting.
        chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(chunk, dtype=np.uint8, count=1).ctypes.data
        start = _round_up(base, HUGE_PAGE) - base  # a multiple of the 4 KiB page
        chunk.madvise(mmap.MADV_HUGEPAGE, start, size - start)
        self._chunk = weakref.ref(chunk)
        self._offset, self._end = start, size
        return chunk


_arena = WeightArena()


def weight_array(nbytes: int) -> npt.NDArray[np.uint8]:
    """An uninitialized uint8 array for a repacked weight: on huge pages where available."""
    if huge_pages_available():
        return _arena.empty(nbytes)
    return np.empty(max(1, nbytes), dtype=np.uint8)[:nbytes]


def weight_buffer(nbytes: int) -> torch.Tensor:
    """`weight_array` as a tensor (the torch modules' weights; it shares the memory)."""
    import torch

    return torch.from_numpy(weight_array(nbytes))
