"""Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K weights repacked into 16 interleaved rows (`csrc/q8repack.h`, the AVX-512
VNNI build's layout for `--quantization auto`):

- every output is within float rounding of the plain reference of llama.cpp's scheme
  (tests/models/q8_reference.py), for M = 1..9 (the register tile's edges), 17 and 33 rows,
  one and many blocks, with and without the group decoded ahead; and it is within rounding of
  the GGUF layout's kernel too (the same integer sums, the float sums in another order);
- the thread split changes no bit; embedding rows read from the packed layout are bit for bit
  the GGUF layout's dequantized rows;
- a build without the layout (every level but v4-vnni) reports it, and keeps the GGUF layout;
  bad shapes are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from slotserve.models import native_build, native_qmatmul
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_qmatmul import QuantWeight, qmatmul_available
from tests.checkpoint.gguf_convert import Q
from tests.models import q8_reference as ref
from tests.models.test_qmatmul_int8 import assert_split_changes_no_bit, weight

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
LEVELS = native_build.supported_levels()


@pytest.fixture(scope="module")
def lib() -> native_qmatmul._Lib:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"
    vnni = next((lv for lv in LEVELS if lv.name == "v4-vnni"), None)
    if vnni is None:
        pytest.skip("this CPU has no AVX-512 VNNI: no packed layout to test")
    lib = native_qmatmul.level_library(vnni)
    assert lib is not None
    return lib


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_matmul_equals_llamacpps_scheme(lib: native_qmatmul._Lib, qtype: Q) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    for i, (m, n, blocks) in enumerate([(1, 16, 1), (2, 32, 3), (3, 48, 20), (4, 16, 2),
                                        (5, 16, 1), (6, 32, 5), (7, 16, 2), (8, 16, 3),
                                        (9, 64, 20), (17, 32, 2), (33, 16, 70)]):
        if block == 256:  # the K-quants' blocks are 8 times longer
            blocks = -(-blocks // 8)
        k = blocks * block
        data, dense = weight(qtype, n, k, seed=40 + i)
        plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
        packed = plain.repacked()
        assert packed.packed and packed.blocks.shape == plain.blocks.shape
        assert not np.array_equal(packed.blocks.numpy(), data)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        got = torch.full((m, n), float("nan"))
        old = torch.full((m, n), float("nan"))
        packed.matmul(x, got)
        plain.matmul(x, old)
        want = ref.matmul(x.numpy(), dense, None, plain.act_kind)
        bound = ref.bound(x.numpy(), dense, plain.act_kind)
        excess = (np.abs(got.numpy() - want) / bound).max()
        assert excess <= 1.0, f"{m}x{n}x{k}: error {excess:.2f}x the rounding bound"
        assert (np.abs(got.numpy() - old.numpy()) / bound).max() <= 2.0


def test_packed_thread_split_changes_no_bit(lib: native_qmatmul._Lib) -> None:
    k, n = 640, 4096
    data, _ = weight(Q.Q5_0, n, k, seed=3)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q5_0), k, lib=lib).repacked()
    assert_split_changes_no_bit(w, torch.randn(9, k, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_rows_are_the_gguf_rows(lib: native_qmatmul._Lib, qtype: Q) -> None:
    k, n = 3 * GGML_QUANT_SIZES[qtype][0], 48
    data, _ = weight(qtype, n, k, seed=7)
    plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    packed = plain.repacked()
    ids = torch.tensor([0, 15, 16, 47, 31, 5])
    want, got = torch.empty(6, k), torch.empty(6, k)
    plain.rows(ids, want)
    packed.rows(ids, got)
    assert torch.equal(got, want)
    with pytest.raises(NativeKernelError, match="row id"):
        packed.rows(torch.tensor([48]), torch.empty(1, k))


def test_without_the_layout_weights_stay_as_they_are(lib: native_qmatmul._Lib) -> None:
    k = 64
    data, _ = weight(Q.Q8_0, 17, k, seed=9)  # 17 rows: not whole groups
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
        assert w.can_repack == (level.name == "v4-vnni")
        if not w.can_repack:
            with pytest.raises(NativeKernelError, match="no packed layout"):
                QuantWeight(torch.from_numpy(data), int(Q.Q8_0), k, lib=other, packed=True)
