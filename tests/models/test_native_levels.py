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
from slotserve.models.kv_storage import dequantize_rows, quantize_rows

LEVELS = native_build.supported_levels()


@pytest.fixture(scope="module")
def cc() -> str:
    found = native_build.find_compiler()
    if found is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    return found


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build folder for the kv-dtype tests: compile_library builds each level's kernel
    into it once and every later test at that level loads that library, one build per level
    instead of one per test. Building is what test_decode_attention_at_every_level and
    test_levels_are_cached_apart test, each in a folder of its own."""
    return tmp_path_factory.mktemp("native_levels")


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


def level_kernel(cc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 level: native_build.CpuLevel) -> None:
    lib = native_build.compile_library(native_attention.KERNEL, cc, tmp_path, level)
    monkeypatch.setattr(native_attention, "_native_fn", native_attention._load(lib))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           ctx_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))
    scratch = torch.zeros(1, q.shape[1] * int(ctx_lens.max()))
    native_attention.paged_decode(q, k_cache, v_cache, table, ctx_lens, window, 0.3, out,
                                  scratch)
    return out


# (query heads, KV heads, head_dim, block size): odd head counts, GQA ratios 1, 3, 4, 5 and 6
# (the kernel takes query heads in tiles of up to 4: 5 = 4 + 1, 6 = 4 + 2), head_dims of one
# 16-lane chunk, of no multiple of 32 (one int8 block per row) and Gemma's 256.
SHAPES = [(3, 3, 16, 5), (6, 2, 48, 4), (4, 1, 256, 16), (5, 1, 32, 7), (8, 2, 64, 3),
          (12, 2, 32, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
def test_each_kv_dtype_reads_as_its_float32_values(cc: str, build_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   level: native_build.CpuLevel,
                                                   kv_dtype: torch.dtype,
                                                   shape: tuple[int, int, int, int]) -> None:
    """At every level a 16- or 8-bit cache gives what a float32 cache holding the values it
    stores gives: bit for bit for the 16-bit types (the widening is exact and the arithmetic
    the same), within float rounding for int8 (its scale is applied after the dot product).
    Contexts end inside, at the end of and at the start of a block, one under a window."""
    heads, kvh, dim, bs = shape
    level_kernel(cc, build_dir, monkeypatch, level)
    gen = torch.Generator().manual_seed(heads * dim + bs)
    nd, nblocks = 4, 40
    x_k = torch.randn(nblocks, bs, kvh, dim, generator=gen)
    x_v = torch.randn(nblocks, bs, kvh, dim, generator=gen)
    if kv_dtype == torch.int8:
        k_cache, v_cache = quantize_rows(x_k), quantize_rows(x_v)
        k32, v32 = (dequantize_rows(c, dim, torch.float32) for c in (k_cache, v_cache))
    else:
        k_cache, v_cache = x_k.to(kv_dtype), x_v.to(kv_dtype)
        k32, v32 = k_cache.float(), v_cache.float()
    q = torch.randn(nd, heads, dim, generator=gen)
    table = torch.randperm(nblocks, generator=gen)[:nd * 10].reshape(nd, 10)
    ctx_lens = torch.tensor([3 * bs - 1, 2 * bs, 4 * bs + 1, 1])
    for window in (None, bs + 2):
        got = decode(q, k_cache, v_cache, table, ctx_lens, window)
        want = decode(q, k32, v32, table, ctx_lens, window)
        if kv_dtype == torch.int8:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)
    full = dense_decode(q, k32, v32, table, ctx_lens, 0.3)
    torch.testing.assert_close(decode(q, k_cache, v_cache, table, ctx_lens).double(), full,
                               rtol=1e-5, atol=1e-5)


def test_levels_are_cached_apart(cc: str, tmp_path: Path) -> None:
    """Each level is its own library file (one cache folder serves every CPU)."""
    paths = {native_build.compile_library(native_attention.KERNEL, cc, tmp_path, lv)
             for lv in LEVELS[:2]}
    assert len(paths) == min(2, len(LEVELS)) and all(p.is_file() for p in paths)
