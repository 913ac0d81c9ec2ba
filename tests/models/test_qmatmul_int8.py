"""The int8-activation matmul (`--quantization auto`; `csrc/q8act.h`, `csrc/q8dot.h`) against
a plain numpy reference of llama.cpp's scheme (tests/models/q8_reference.py), at every CPU
level this machine runs (AVX-512 VNNI, AVX-512, AVX-VNNI, AVX2, portable C):

- activation rows quantize to Q8_0 / Q8_1 / Q8_K bit for bit as llama.cpp's reference
  quantizers round them (ties, an all-zero block, a negative largest value included);
- for every weight type and odd shapes (M = 1, 2, 3, 17, 33 rows; N not a multiple of the
  4-row tile; K one block and several) every output is within float rounding of the
  reference's integer dots times the scales;
- the thread split changes no bit, the kernel refuses bad arguments itself, and a level can be
  forced (SLOTSERVE_CPU_LEVEL) or is refused when the CPU lacks it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from slotserve.errors import ConfigError
from slotserve.models import native_build, native_qmatmul
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_qmatmul import KERNEL_TYPES, QuantWeight, qmatmul_available
from tests.checkpoint.gguf_convert import Q, encode
from tests.models import q8_reference as ref

TYPES = [Q(t) for t in KERNEL_TYPES]
LEVELS = native_build.supported_levels()
WITH_MIN = {Q.Q4_1: 20, Q.Q5_1: 24}  # bytes per block; m is the fp16 at bytes 2..4


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"


def lib_for(level: native_build.CpuLevel) -> native_qmatmul._Lib:
    lib = native_qmatmul.level_library(level)
    assert lib is not None, f"the kernel did not build for {level.name}"
    return lib


def weight(qtype: Q, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = np.ascontiguousarray(encode(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                       qtype, rng))
    return data, dequantize(data, qtype).reshape(n, k).astype(np.float32)


def block_mins(data: np.ndarray, qtype: Q) -> np.ndarray | None:
    if qtype not in WITH_MIN:
        return None
    blocks = data.reshape(data.shape[0], -1, WITH_MIN[qtype])
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)


def parse_row(row: np.ndarray, kind: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's quantized row (q8act.h's layout) as (q, d, s or bsums or -sum(q))."""
    nb = k // (256 if kind == ref.Q8_K else 32)
    q = row[:k].view(np.int8)
    d = row[k:k + 4 * nb].view(np.float32)
    if kind == ref.Q8_K:
        extra = row[k + 4 * nb:k + 4 * nb + 2 * (k // 16)].view(np.int16).astype(np.float32)
    elif kind == ref.Q8_1:
        extra = row[k + 4 * nb:k + 8 * nb].view(np.float32)
    else:  # Q8_0: -sum(q) per block, the unsigned-weight tiles' offset correction
        extra = row[k + 4 * nb:k + 8 * nb].view(np.int32).astype(np.float32)
    return q, d, extra


def awkward_rows(k: int) -> torch.Tensor:
    """Random rows plus rows that hit the rounding's edges: exact .5 ties after scaling, an
    all-zero block, a block whose largest magnitude is negative, tiny values."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(6, k, generator=gen)
    x[1] = torch.arange(k, dtype=torch.float32) % 32 - 15.5  # d = 16.5/127: many near ties
    x[2, :32] = 0.0
    x[2, 32:] = torch.linspace(-3, 1, k - 32)
    x[3] = -x[3].abs()
    x[4] = torch.randn(k, generator=gen) * 1e-6
    x[5] = (torch.arange(k, dtype=torch.float32) % 255 - 127) / 127 * 2.0  # q = x * 63.5
    return x


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=["Q8_0", "Q8_1", "Q8_K"])
def test_activations_quantize_as_llamacpp_rounds_them(level: native_build.CpuLevel,
                                                      qtype: Q) -> None:
    lib = lib_for(level)
    k = 512
    data, _ = weight(qtype, 4, k, seed=1)
    w = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    x = awkward_rows(k)
    got = w.quantize(x).numpy()
    kind = w.act_kind
    for i, row in enumerate(x.numpy()):
        q, d, extra = parse_row(got[i], kind, k)
        rq, rd, rextra = ref.quantize_row(row, kind)
        if kind == ref.Q8_0:
            rextra = -rq.reshape(-1, 32).astype(np.float32).sum(axis=1)
        assert np.array_equal(q, rq), f"row {i}: q differs at {np.flatnonzero(q != rq)[:5]}"
        assert np.array_equal(d, rd), f"row {i}: d"
        assert np.array_equal(extra, rextra), f"row {i}: s / bsums / -sum(q)"


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_int8_matmul_equals_llamacpps_scheme(level: native_build.CpuLevel, qtype: Q) -> None:
    lib = lib_for(level)
    block = GGML_QUANT_SIZES[qtype][0]
    for i, (m, n, blocks) in enumerate([(1, 1, 1), (2, 7, 3), (3, 13, 1), (17, 6, 2),
                                        (33, 9, 1), (1, 21, 640 // block or 3)]):
        k = blocks * block
        data, dense = weight(qtype, n, k, seed=10 + i)
        w = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        out = torch.full((m, n), float("nan"))
        w.matmul(x, out)
        kind = w.act_kind
        want = ref.matmul(x.numpy(), dense, block_mins(data, qtype), kind)
        excess = (np.abs(out.numpy() - want) / ref.bound(x.numpy(), dense, kind)).max()
        assert excess <= 1.0, f"{m}x{n}x{k}: error {excess:.2f}x the rounding bound"


def test_levels_agree_closely_and_the_cpu_gets_its_best() -> None:
    """Different instructions, the same integer sums: the levels differ only in the order of
    float additions. The default level is the best this CPU supports."""
    assert native_build.cpu_level() == LEVELS[0]
    k, n, m = 256, 10, 5
    data, _ = weight(Q.Q6_K, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    outs = []
    for level in LEVELS:
        out = torch.empty(m, n)
        QuantWeight(torch.from_numpy(data), int(Q.Q6_K), k, lib=lib_for(level)).matmul(x, out)
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_threads_split_the_rows_without_changing_a_bit() -> None:
    k, n, m = 640, 4101, 8  # split (over the pool's bar), not at multiples of the tile
    data, _ = weight(Q.Q8_0, n, k, seed=8)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k)
    assert_split_changes_no_bit(w, torch.randn(m, k, generator=torch.Generator().manual_seed(8)))


def assert_split_changes_no_bit(w: QuantWeight, x: torch.Tensor) -> None:
    """One thread and two give the same bits (test_qmatmul_repack too)."""
    one, two = torch.empty(x.shape[0], w.n), torch.empty(x.shape[0], w.n)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        w.matmul(x, one)
        torch.set_num_threads(2)
        w.matmul(x, two)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


def test_the_kernel_checks_its_arguments_itself() -> None:
    lib = native_qmatmul._library()
    k, n = 64, 8
    w = np.zeros((n, 68), dtype=np.uint8)  # Q8_0: 34 bytes per 32 values
    x, y = np.zeros((2, k), np.float32), np.zeros((2, n), np.float32)
    kind = lib.act_kind[int(Q.Q8_0)]
    rb = lib.act_row_bytes(kind, k)
    act = np.zeros(2 * rb, np.uint8)
    assert lib.act_row_bytes(kind, k + 1) == -1 and lib.act_row_bytes(7, k) == -1
    assert lib.quantize(kind, x.ctypes.data, k, 2, k, act.ctypes.data, act.size) == 0
    assert lib.quantize(kind, x.ctypes.data, k, 2, k, act.ctypes.data, act.size - 1) == 3
    assert lib.quantize(kind, x.ctypes.data, k - 1, 2, k, act.ctypes.data, act.size) == 2

    def call(qtype: int, row_bytes: int, n1: int, act_len: int) -> int:
        return lib.q8_matmul(qtype, w.ctypes.data, n, k, row_bytes, act.ctypes.data, act_len,
                             2, y.ctypes.data, n, 0, n1, 1)

    assert call(int(Q.Q8_0), 68, n, act.size) == 0
    assert call(int(Q.Q2_K), 68, n, act.size) == 1
    assert call(int(Q.Q8_0), 66, n, act.size) == 2
    assert call(int(Q.Q8_0), 68, n + 1, act.size) == 2
    assert call(int(Q.Q8_0), 68, n, act.size - 1) == 3


def test_quantize_refuses_a_bad_x() -> None:
    data, _ = weight(Q.Q8_0, 4, 64, seed=6)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), 64)
    with pytest.raises(NativeKernelError, match="float32"):
        w.quantize(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(NativeKernelError, match="float32"):
        w.quantize(torch.zeros(2, 96))


def test_a_level_can_be_forced_and_a_missing_one_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lowest = LEVELS[-1]
    monkeypatch.setenv("SLOTSERVE_CPU_LEVEL", lowest.name)
    assert native_build.cpu_level() == lowest
    monkeypatch.setenv("SLOTSERVE_CPU_LEVEL", "v9")
    with pytest.raises(ConfigError, match="v9"):
        native_build.cpu_level()
