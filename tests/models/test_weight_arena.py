"""Repacked weights live on transparent huge pages (`models/weight_arena.py`): buffers carved
from 2 MiB-aligned private chunks advised MADV_HUGEPAGE, each 64-byte aligned, never
overlapping, small ones sharing a chunk; a chunk goes when its last weight does; off with
SLOTSERVE_HUGE_PAGES=0; a repacked weight multiplies to the same bits either way."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from slotserve.models import weight_arena
from slotserve.models.native_qmatmul import QuantWeight, qmatmul_available
from slotserve.models.weight_arena import HUGE_PAGE, WeightArena, weight_buffer
from tests.checkpoint.gguf_convert import Q
from tests.models.test_qmatmul_int8 import weight

needs_thp = pytest.mark.skipif(not weight_arena.huge_pages_available(),
                               reason="no transparent huge pages here")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    smaps = Path("/proc/self/smaps").read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?AnonHugePages:\s+(\d+) kB", smaps,
                         re.M | re.S):
        if int(m[1], 16) <= address < int(m[2], 16):
            return int(m[3])
    raise AssertionError("no mapping holds the address")


@needs_thp
def test_a_large_weight_is_on_huge_pages() -> None:
    buf = weight_buffer(12 * HUGE_PAGE + 12345)
    buf.fill_(7)  # first touch: faulted in as huge pages
    assert _anon_huge_kib(buf.data_ptr()) >= 11 * HUGE_PAGE // 1024
    assert int(buf[-1]) == 7 and buf.numel() == 12 * HUGE_PAGE + 12345


@needs_thp
@pytest.mark.skipif(not qmatmul_available(), reason="native qmatmul does not build here")
def test_a_repacked_weight_is_on_huge_pages() -> None:
    data, _ = weight(Q.Q8_0, 4096, 2048, seed=2)  # 8.9 MB
    plain = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), 2048)
    if not plain.can_repack:
        pytest.skip("no packed layout at this CPU level")
    packed = plain.repacked()
    assert _anon_huge_kib(packed.blocks.data_ptr()) >= 2 * HUGE_PAGE // 1024


def test_buffers_are_aligned_disjoint_and_share_a_chunk() -> None:
    arena = WeightArena(chunk_bytes=8 * HUGE_PAGE)
    bufs = [arena.empty(n) for n in (1, 100, 4096, 65 * 1000, 3)]
    spans = sorted((b.ctypes.data, b.ctypes.data + b.size) for b in bufs)
    assert all(b.ctypes.data % 64 == 0 for b in bufs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] - spans[0][0] < 8 * HUGE_PAGE  # one chunk
    for i, b in enumerate(bufs):
        b.fill(i)
    assert [int(b[0]) for b in bufs] == list(range(len(bufs)))
    big = arena.empty(9 * HUGE_PAGE)  # larger than a chunk: a chunk of its own
    assert big.ctypes.data % HUGE_PAGE == 0 and big.size == 9 * HUGE_PAGE


def test_a_chunk_is_freed_with_its_last_weight() -> None:
    arena = WeightArena(chunk_bytes=2 * HUGE_PAGE)
    first = arena.empty(1024)
    chunk = arena._chunk
    assert chunk is not None and chunk() is not None
    del first
    gc.collect()
    assert chunk() is None  # the arena kept only a weak reference
    again = arena.empty(1024)  # and starts a new chunk
    assert arena._chunk is not None and arena._chunk() is not None and again.size == 1024


def test_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_arena.HUGE_PAGES_ENV, "0")
    assert not weight_arena.huge_pages_available()
    buf = weight_buffer(5000)
    assert buf.dtype == torch.uint8 and buf.numel() == 5000


@pytest.mark.skipif(not qmatmul_available(), reason="native qmatmul does not build here")
def test_repacked_weight_multiplies_the_same_on_either_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = weight(Q.Q8_0, 64, 256, seed=3)
    plain = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), 256)
    if not plain.can_repack:
        pytest.skip("no packed layout at this CPU level")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv(weight_arena.HUGE_PAGES_ENV, env)
        packed = plain.repacked()
        assert packed.packed and packed.blocks.shape == plain.blocks.shape
        out = torch.full((3, 64), float("nan"))
        packed.matmul(x, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
