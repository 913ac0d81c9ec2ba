"""The int8 kernels' software prefetch is chosen per CPU at load (`native_qmatmul.prefetch_policy`:
how many bytes ahead, and from how many activation rows a light type's call prefetches); it
changes when bytes are asked for, never a result:

- every type, in the GGUF layout and repacked, at every level this CPU runs with a layout, at
  row counts on both sides of the row threshold: no prefetch, prefetch from one row and from
  four give the same bits;
- the policy: on AMD a Q4_0 / Q5_0 / Q8_0 call prefetches from four rows (its hardware
  prefetcher streams one or two rows faster alone), elsewhere from one, and a packed Q4_K
  tile asks for its bytes 16 KiB ahead into L2 (into L1 4 KiB ahead elsewhere); on AMD
  without AVX-512, AVX2's int16 Q8_0 path asks 2 KiB ahead below four rows (none elsewhere);
  `SLOTSERVE_PREFETCH` overrides it, and a malformed value is a ConfigError naming the
  variable.
"""

from __future__ import annotations

import pytest
import torch

from slotserve.errors import ConfigError
from slotserve.models import native_build, native_qmatmul, qmatmul_lib
from slotserve.models.native_qmatmul import QuantWeight, qmatmul_available
from tests.checkpoint.gguf_convert import Q
from tests.models.test_qmatmul_int8 import weight

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_K]
POLICIES = [(0, 1, 0, 0), (4096, 1, 0, 0), (4096, 4, 0, 0), (64, 2, 0, 0),
            (4096, 4, 16384, 2048), (0, 1, 64, 64)]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"


@pytest.mark.parametrize("level", native_build.supported_levels(), ids=lambda lv: lv.name)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_prefetch_changes_no_bit(level: native_build.CpuLevel, qtype: Q) -> None:
    lib = native_qmatmul.level_library(level)
    assert lib is not None, f"the kernel did not build for {level.name}"
    block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    n, k = 70, 2 * block
    data, _ = weight(qtype, n, k, seed=int(qtype))
    plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    weights = [plain, plain.repacked()] if plain.can_repack else [plain]
    gen = torch.Generator().manual_seed(1)
    try:
        for m in (1, 2, 3, 4, 9, 33):
            x = torch.randn(m, k, generator=gen)
            for w in weights:
                outs = []
                for policy in POLICIES:
                    lib.set_prefetch(*policy)
                    y = torch.full((m, n), float("nan"))
                    w.matmul(x, y)
                    outs.append(y)
                assert all(torch.equal(outs[0], y) for y in outs[1:]), \
                    f"{qtype.name} m={m} packed={w.packed}: a prefetch policy changed bits"
    finally:
        lib.set_prefetch(*native_qmatmul.prefetch_policy())


def test_policy_by_vendor_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTSERVE_PREFETCH", raising=False)
    monkeypatch.setattr(qmatmul_lib, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(qmatmul_lib, "cpu_has_avx512", lambda: True)
    assert native_qmatmul.prefetch_policy() == (4096, 4, 16384, 0)
    monkeypatch.setattr(qmatmul_lib, "cpu_has_avx512", lambda: False)
    assert native_qmatmul.prefetch_policy() == (4096, 4, 16384, 2048)
    monkeypatch.setattr(qmatmul_lib, "cpu_vendor", lambda: "GenuineIntel")
    assert native_qmatmul.prefetch_policy() == (4096, 1, 0, 0)
    monkeypatch.setenv("SLOTSERVE_PREFETCH", "0")
    assert native_qmatmul.prefetch_policy() == (0, 1, 0, 0)
    monkeypatch.setenv("SLOTSERVE_PREFETCH", "2048,8")
    assert native_qmatmul.prefetch_policy() == (2048, 8, 0, 0)
    monkeypatch.setenv("SLOTSERVE_PREFETCH", "4096,4,8192")
    assert native_qmatmul.prefetch_policy() == (4096, 4, 8192, 0)
    monkeypatch.setenv("SLOTSERVE_PREFETCH", "4096,4,8192,1024")
    assert native_qmatmul.prefetch_policy() == (4096, 4, 8192, 1024)
    for bad in ("-1", "a", "1,2,3,4,5", "4096,", "1,1,-1", "1,1,1,-1"):
        monkeypatch.setenv("SLOTSERVE_PREFETCH", bad)
        with pytest.raises(ConfigError, match="SLOTSERVE_PREFETCH"):
            native_qmatmul.prefetch_policy()
