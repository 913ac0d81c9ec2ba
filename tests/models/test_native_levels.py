"""Every native kernel builds and computes right at every CPU level this machine runs
(native_build.CPU_LEVELS: AVX-512 with and without VNNI, AVX2 with and without AVX-VNNI,
portable x86-64-v2), not only at the level the CPU picks: the decode-attention kernel with
each of its link variants (libmvec's vector expf, and the plain `-lm` fallback) against
dense attention in torch. (The quantized matmul's levels: test_qmatmul.py, test_qmatmul_int8.py.)
With CI=true a kernel that cannot build fails here, as everywhere.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from slotserve.models import native_attention, native_build

LEVELS = native_build.supported_levels()


@pytest.fixture(scope="module")
def cc() -> str:
    found = native_build.find_compiler()
    if found is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    return found


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    nd, heads, dim = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(nd, heads * dim, dtype=torch.float64)
    for b in range(nd):
        n = int(ctx_lens[b])
        pos = torch.arange(n)
        blocks = table[b, pos // bs]
        keys = k_cache[blocks, pos % bs].double()  # [n, kvh, dim]
        vals = v_cache[blocks, pos % bs].double()
        for h in range(heads):
            g = h // (heads // kvh)
            p = torch.softmax(scale * keys[:, g] @ q[b, h].double(), dim=0)
            out[b, h * dim:(h + 1) * dim] = p @ vals[:, g]
    return out


@pytest.mark.parametrize("link", native_attention.KERNEL.link_variants,
                         ids=lambda v: " ".join(v) or "none")
@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
def test_decode_attention_at_every_level(cc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         level: native_build.CpuLevel,
                                         link: tuple[str, ...]) -> None:
    kernel = replace(native_attention.KERNEL, link_variants=(link,))
    lib = native_build.compile_library(kernel, cc, tmp_path, level)
    monkeypatch.setattr(native_attention, "_native_fn", native_attention._load(lib))
    gen = torch.Generator().manual_seed(1)
    nd, heads, kvh, dim, bs, nblocks = 3, 4, 2, 32, 4, 12
    q = torch.randn(nd, heads, dim, generator=gen)
    k_cache = torch.randn(nblocks, bs, kvh, dim, generator=gen)
    v_cache = torch.randn(nblocks, bs, kvh, dim, generator=gen)
    table = torch.tensor([[3, 1, 7], [2, 0, 5], [11, 9, 4]])
    ctx_lens = torch.tensor([1, 6, 12])
    out = torch.zeros(nd, heads * dim)
    native_attention.paged_decode(q, k_cache, v_cache, table, ctx_lens, None, 0.2, out,
                                  torch.zeros(1, heads * 12))
    want = dense_decode(q, k_cache, v_cache, table, ctx_lens, 0.2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_levels_are_cached_apart(cc: str, tmp_path: Path) -> None:
    """Each level is its own library file (one cache folder serves every CPU)."""
    paths = {native_build.compile_library(native_attention.KERNEL, cc, tmp_path, lv)
             for lv in LEVELS[:2]}
    assert len(paths) == min(2, len(LEVELS)) and all(p.is_file() for p in paths)
