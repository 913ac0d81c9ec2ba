"""Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K weights repacked into groups of interleaved rows
(`csrc/q8repack.h`) for `--quantization auto`: 16 rows with AVX-512 VNNI (q8repack512.h), 8
with AVX2, with or without AVX-VNNI, and AVX-512 without VNNI (q8repack256.h), each tested at
every level this CPU runs:

- every output is within float rounding of the plain reference of llama.cpp's scheme
  (tests/models/q8_reference.py), for M = 1..9 (the register tiles' edges), 17 and 33 rows,
  one and many blocks; and it is within rounding of the GGUF layout's kernel too (the same
  integer sums, the float sums in another order);
- weights at their extremes (every byte 0xff or random, Q8_0's -128 included) times
  activations at +-127 give the reference's values: AVX2's int16 partial sums never saturate;
- AVX2's Q8_0 in int16 (rp_q8_tile16) gives rp_tile's bits, with its activations widened in
  passes of a few rows, and rows too long for its buffer take rp_tile itself;
- the thread split changes no bit, nor does decoding a group once for a wide call; embedding rows read from the packed layout are bit for bit
  the GGUF layout's dequantized rows (the layout round-trips);
- a build without the layout (the portable levels) reports it and keeps the GGUF layout, and
  every level compiles, the AVX-VNNI one too on a CPU without AVX-VNNI (whose tests skip);
  bad shapes are refused.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from slotserve.models import native_build, native_qmatmul, qmatmul_lib
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_qmatmul import QuantWeight, qmatmul_available
from tests.checkpoint.gguf_convert import Q
from tests.models import q8_reference as ref
from tests.models.test_qmatmul_int8 import assert_split_changes_no_bit, weight

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
LEVELS = native_build.supported_levels()
# Rows per packed group at each level (0: no packed layout).
GROUP_ROWS = {"v4-vnni": 16, "v4": 8, "v3-vnni": 8, "v3": 8, "v2": 0, "portable": 0}
PACKED_LEVELS = [lv for lv in native_build.CPU_LEVELS if GROUP_ROWS[lv.name]]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"


@pytest.fixture(params=PACKED_LEVELS, ids=lambda lv: lv.name)
def lib(request: pytest.FixtureRequest) -> qmatmul_lib.QMatmulLib:
    level: native_build.CpuLevel = request.param
    if level not in LEVELS:
        pytest.skip(f"this CPU does not run {level.name} ({level.what})")
    lib = native_qmatmul.level_library(level)
    assert lib is not None, f"the kernel did not build for {level.name}"
    assert lib.repack_rows[int(Q.Q8_0)] == GROUP_ROWS[level.name]
    return lib


def check_packed(lib: qmatmul_lib.QMatmulLib, qtype: Q, data: np.ndarray, dense: np.ndarray,
                 x: torch.Tensor, what: str) -> None:
    n, k = dense.shape
    plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    packed = plain.repacked()
    assert packed.packed and packed.blocks.shape == plain.blocks.shape
    assert not np.array_equal(packed.blocks.numpy(), data)
    m = x.shape[0]
    got = torch.full((m, n), float("nan"))
    old = torch.full((m, n), float("nan"))
    packed.matmul(x, got)
    plain.matmul(x, old)
    want = ref.matmul(x.numpy(), dense, None, plain.act_kind)
    bound = ref.bound(x.numpy(), dense, plain.act_kind)
    excess = (np.abs(got.numpy() - want) / bound).max()
    assert excess <= 1.0, f"{what}: error {excess:.2f}x the rounding bound"
    assert (np.abs(got.numpy() - old.numpy()) / bound).max() <= 2.0, what


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_matmul_equals_llamacpps_scheme(lib: qmatmul_lib.QMatmulLib, qtype: Q) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    rows = lib.repack_rows[int(qtype)]
    for i, (m, groups, blocks) in enumerate([(1, 1, 1), (2, 2, 3), (3, 3, 20), (4, 1, 2),
                                             (5, 1, 1), (6, 2, 5), (7, 1, 2), (8, 1, 3),
                                             (9, 4, 20), (17, 2, 2), (33, 1, 70),
                                             # past the blocks a group is decoded ahead for
                                             (6, 1, 136)]):
        if block == 256:  # the K-quants' blocks are 8 times longer
            blocks = -(-blocks // 8)
        k, n = blocks * block, groups * rows
        data, dense = weight(qtype, n, k, seed=40 + i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        check_packed(lib, qtype, data, dense, x, f"{m}x{n}x{k}")


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_matmul_at_the_extremes(lib: qmatmul_lib.QMatmulLib, qtype: Q) -> None:
    """Every weight byte 0xff (the largest nibbles, 5- and 6-bit values; Q8_0's -1) or random
    (Q8_0's -128 and 127), one small scale; activation rows whose every value quantizes to +-127,
    of one sign or mixed: the integer sums at their largest."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = lib.repack_rows[int(qtype)]
    k, n = 2 * 256, 2 * rows
    rng = np.random.default_rng(1)
    scale_at = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    x = torch.tensor(np.stack([np.full(k, 1.5), np.full(k, -2.0),
                               np.where(rng.random(k) < 0.5, 1.0, -1.0)]), dtype=torch.float32)
    for fill in ("ones", "random"):
        raw = (np.full((n, k // block * size), 0xff, np.uint8) if fill == "ones"
               else rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8))
        blocks = raw.reshape(n, k // block, size)
        for off in scale_at:
            blocks[:, :, off:off + 2] = np.array([1e-3], np.float16).view(np.uint8)
        if qtype == Q.Q8_0 and fill == "random":
            blocks[:, :, 2:6] = np.array([0x80, 0x7f, 0x80, 0x81], np.uint8)  # -128, 127, ...
        dense = dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        check_packed(lib, qtype, raw, dense, x, fill)


def test_avx2_q8_0_passes_and_long_rows_change_no_bit(tmp_path: Path) -> None:
    """The v3 kernel built with a 1280-value int16 buffer (RP_A16) against the default one:
    K = 640 widens two activation rows a pass, K = 1312 is too long and runs rp_tile's
    |w| x sign(a, w) products; both give the default build's bits (one pass of int16)."""
    v3 = next((lv for lv in LEVELS if lv.name == "v3"), None)
    cc = native_build.find_compiler()
    if v3 is None or cc is None:
        pytest.skip("this CPU does not run AVX2")
    default = native_qmatmul.level_library(v3)
    kernel = replace(native_qmatmul.KERNEL, cflags=(*native_qmatmul.KERNEL.cflags,
                                                    "-DRP_A16=1280"))
    small = qmatmul_lib.QMatmulLib(ctypes.CDLL(str(native_build.compile_library(kernel, cc,
                                                                              tmp_path, v3))))
    assert default is not None
    for k, seed in ((640, 11), (1312, 12)):
        data, dense = weight(Q.Q8_0, 24, k, seed=seed)
        if seed == 12:  # -128 and 127, the sign products' edge
            data.reshape(24, -1, 34)[:, :, 2:4] = np.array([0x80, 0x7f], np.uint8)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(seed))
        got, want = torch.empty(9, 24), torch.empty(9, 24)
        QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=small).repacked().matmul(x, got)
        QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=default).repacked().matmul(x, want)
        assert torch.equal(got, want), k


def test_packed_thread_split_changes_no_bit(lib: qmatmul_lib.QMatmulLib) -> None:
    k, n = 640, 4096
    data, _ = weight(Q.Q5_0, n, k, seed=3)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q5_0), k, lib=lib).repacked()
    assert_split_changes_no_bit(w, torch.randn(9, k, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_a_wide_call_gives_each_rows_bits(lib: qmatmul_lib.QMatmulLib, qtype: Q) -> None:
    """A call of many rows decodes each group once ahead (Q4_0 / Q5_0 / Q6_K, more than one
    tile of rows); one row decodes as it goes: the same integer and float steps, so the same
    bits."""
    k, n = 5 * GGML_QUANT_SIZES[qtype][0], 2 * lib.repack_rows[int(qtype)]
    data, _ = weight(qtype, n, k, seed=11)
    w = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib).repacked()
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(12))
    wide = torch.empty(19, n)
    w.matmul(x, wide)
    for i in range(19):
        one = torch.empty(1, n)
        w.matmul(x[i:i + 1], one)
        assert torch.equal(one[0], wide[i]), f"row {i}"


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_rows_are_the_gguf_rows(lib: qmatmul_lib.QMatmulLib, qtype: Q) -> None:
    k, n = 3 * GGML_QUANT_SIZES[qtype][0], 48
    data, _ = weight(qtype, n, k, seed=7)
    if qtype == Q.Q8_0:  # -128, whose + 128 and sign are the layout's edge
        data.reshape(n, -1, 34)[:, :, 2] = 0x80
    plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    packed = plain.repacked()
    ids = torch.tensor([0, 7, 8, 15, 16, 47, 31, 5])
    want, got = torch.empty(8, k), torch.empty(8, k)
    plain.rows(ids, want)
    packed.rows(ids, got)
    assert torch.equal(got, want)
    with pytest.raises(NativeKernelError, match="row id"):
        packed.rows(torch.tensor([48]), torch.empty(1, k))


def test_without_the_layout_weights_stay_as_they_are(lib: qmatmul_lib.QMatmulLib) -> None:
    k = 64
    rows = lib.repack_rows[int(Q.Q8_0)]
    data, _ = weight(Q.Q8_0, rows + 1, k, seed=9)  # not whole groups
    odd = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=lib)
    assert not odd.can_repack and odd.repacked() is odd
    data, _ = weight(Q.Q5_K, 16, 256, seed=9)
    assert not QuantWeight(torch.from_numpy(data), int(Q.Q5_K), 256, lib=lib).can_repack
    data, _ = weight(Q.Q8_0, 16, k, seed=9)
    exact = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, int8=False, lib=lib)
    assert not exact.can_repack
    for level in LEVELS:
        other = native_qmatmul.level_library(level)
        assert other is not None
        w = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=other)
        assert w.can_repack == (GROUP_ROWS[level.name] > 0)
        if not w.can_repack:
            with pytest.raises(NativeKernelError, match="no packed layout"):
                QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=other, packed=True)


@pytest.mark.parametrize("level", native_build.CPU_LEVELS, ids=lambda lv: lv.name)
def test_every_level_compiles(level: native_build.CpuLevel) -> None:
    """Levels this CPU cannot run (AVX-VNNI here) are built, never loaded: their code at least
    compiles wherever the tests run."""
    cc = native_build.find_compiler()
    assert cc is not None
    lib = native_build.compile_library(native_qmatmul.KERNEL, cc, native_build.cache_dir(), level)
    assert lib.is_file()
