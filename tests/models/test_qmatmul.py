"""The native block-quantized matmul's float32-activation path (`--quantization exact`,
`models/csrc/qmatmul.c`) against its reference, dequantize-then-matmul: gguf's own numpy
dequantizer, then a float64 matmul. (The int8 path: test_qmatmul_int8.py.)

For every type with a kernel, on random blocks and odd shapes (rows of x and of W that are not
multiples of the register tile, one-block rows, more rows of x than one L2 block): every
output is within float32 rounding of the reference (|diff| <= k * eps * sum |x||w|, the
classic bound for a dot product of k terms), and dequantized rows are bit for bit gguf's.
Strided x and a column slice of a larger output, the thread split, every CPU level's build of
the same source this machine runs (AVX-512, AVX2, portable), and refused arguments are covered
too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from slotserve.models import native_build, native_qmatmul
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_qmatmul import KERNEL_TYPES, QuantWeight, qmatmul_available
from tests.checkpoint.gguf_convert import Q, encode

TYPES = [Q(t) for t in KERNEL_TYPES]
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"


def random_weight(qtype: Q, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(file blocks [n, bytes per row], gguf's dequantized float32 [n, k])."""
    rng = np.random.default_rng(seed)
    data = encode(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype, rng)
    dense = torch.from_numpy(dequantize(data, qtype).reshape(n, k).astype(np.float32))
    return np.ascontiguousarray(data), dense


def quant(data: np.ndarray, qtype: Q, k: int, lib: object = None) -> QuantWeight:
    return QuantWeight(torch.from_numpy(data.copy()), int(qtype), k, int8=False,
                       lib=lib)  # type: ignore[arg-type]  # a level's _Lib or None


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    ref = x.double() @ dense.double().T
    bound = x.shape[1] * EPS * (x.double().abs() @ dense.double().abs().T) + 1e-30
    excess = ((got.double() - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the float32 rounding bound"


def block_of(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_type_equals_dequantize_then_matmul(qtype: Q) -> None:
    block = block_of(qtype)
    for i, (m, n, blocks) in enumerate([(1, 1, 1), (1, 7, 2), (3, 13, 1), (5, 6, 3),
                                        (37, 70, 2), (2, 4, 1)]):
        k = blocks * block
        data, dense = random_weight(qtype, n, k, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        out = torch.full((m, n), float("nan"))
        quant(data, qtype, k).matmul(x, out)
        assert_within_rounding(out, x, dense)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantized_rows_are_ggufs_bit_for_bit(qtype: Q) -> None:
    k = 2 * block_of(qtype)
    data, dense = random_weight(qtype, 9, k, seed=5)
    ids = torch.tensor([8, 0, 3, 3])
    rows = torch.empty(4, k)
    quant(data, qtype, k).rows(ids, rows)
    assert torch.equal(rows, dense[ids])


def test_many_rows_strided_input_and_a_slice_of_the_output() -> None:
    """More rows of x than one L2 block holds (k=640: 100 rows), x a column slice of a wider
    tensor, out a column slice of a larger output whose other columns stay untouched."""
    k, n, m = 640, 21, 230
    data, dense = random_weight(Q.Q8_0, n, k, seed=7)
    wide = torch.randn(m, k + 9, generator=torch.Generator().manual_seed(7))
    x = wide[:, 5:5 + k]
    big = torch.full((m, n + 10), -7.0)
    quant(data, Q.Q8_0, k).matmul(x, big[:, 4:4 + n])
    assert_within_rounding(big[:, 4:4 + n], x, dense)
    assert (big[:, :4] == -7.0).all() and (big[:, 4 + n:] == -7.0).all()


def test_threads_split_the_rows_without_changing_a_bit() -> None:
    k, n, m = 256, 1030, 9  # 1030 rows: the split is not a multiple of the tile everywhere
    data, _ = random_weight(Q.Q4_K, n, k, seed=8)
    w = quant(data, Q.Q4_K, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    one, three = torch.empty(m, n), torch.empty(m, n)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w.matmul(x, one)
        torch.set_num_threads(3)
        w.matmul(x, three)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, three)


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    k = 64
    data, _ = random_weight(Q.Q5_0, 8, k, seed=9)
    w = quant(data, Q.Q5_0, k)
    out = torch.zeros(2, 8)
    with pytest.raises(NativeKernelError, match="do not fit"):
        w.matmul(torch.zeros(2, k + 32), out)
    with pytest.raises(NativeKernelError, match="float32"):
        w.matmul(torch.zeros(2, k, dtype=torch.float64), out)
    with pytest.raises(NativeKernelError, match="contiguous rows"):
        w.matmul(torch.zeros(k, 2).T, out)
    rows = torch.zeros(2, k)
    with pytest.raises(NativeKernelError, match="outside the weight"):
        w.rows(torch.tensor([1, 8]), rows)
    assert (rows == 0).all()
    with pytest.raises(NativeKernelError, match="take"):  # row bytes of another type
        QuantWeight(torch.from_numpy(data.copy()), int(Q.Q8_0), k)
    with pytest.raises(NativeKernelError, match="no kernel"):
        QuantWeight(torch.from_numpy(data.copy()), int(Q.Q2_K), k)


def test_the_kernel_checks_its_arguments_itself() -> None:
    """The C entry point refuses what the Python checks would have caught (python -O keeps
    those, but any other caller of the library has only these)."""
    lib = native_qmatmul._library()
    k, n = 64, 8
    w = np.zeros((n, 44), dtype=np.uint8)  # Q5_0: 22 bytes per 32 values
    x, y = np.zeros((1, k), np.float32), np.zeros((1, n), np.float32)
    scratch = np.zeros(4 * k, np.float32)

    def call(qtype: int, row_bytes: int, n0: int, n1: int, scratch_len: int) -> int:
        return lib.matmul(qtype, w.ctypes.data, n, k, row_bytes, x.ctypes.data, k, 1,
                          y.ctypes.data, n, n0, n1, scratch.ctypes.data, scratch_len)

    assert call(int(Q.Q5_0), 44, 0, n, scratch.size) == 0
    assert call(int(Q.Q2_K), 44, 0, n, scratch.size) == 1  # no kernel for the type
    assert call(int(Q.Q5_0), 40, 0, n, scratch.size) == 2  # row bytes of another layout
    assert call(int(Q.Q5_0), 44, 0, n + 1, scratch.size) == 2  # rows beyond the weight
    assert call(int(Q.Q5_0), 44, 0, n, 3 * k) == 3  # scratch below one tile
    ids = np.array([0, n], dtype=np.int64)
    out = np.zeros((2, k), np.float32)
    assert lib.rows(int(Q.Q5_0), w.ctypes.data, n, k, 44, ids.ctypes.data, 2,
                    out.ctypes.data, k) == 4


@pytest.mark.parametrize("level", native_build.supported_levels(), ids=lambda lv: lv.name)
def test_every_cpu_level_matches_the_reference(level: native_build.CpuLevel) -> None:
    """Each level's build (AVX-512 fused path, AVX2 tiles, portable loops) gives gguf's
    dequantized values bit for bit and matmuls within rounding, run in this process."""
    lib = native_qmatmul.level_library(level)
    assert lib is not None, f"the kernel did not build for {level.name}"
    for qtype in TYPES:
        k, n, m = 2 * block_of(qtype), 6, 3
        data, dense = random_weight(qtype, n, k, seed=11)
        w = quant(data, qtype, k, lib)
        rows = torch.zeros(n, k)
        w.rows(torch.arange(n), rows)
        assert torch.equal(rows, dense), qtype.name
        for m in (1, 2, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(11))
            y = torch.zeros(m, n)
            w.matmul(x, y)
            assert_within_rounding(y, x, dense)
