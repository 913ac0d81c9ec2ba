"""The one-call int8 matmul (`QMatmulPlan`, `csrc/q8call.h`: quantize x and multiply every
weight sharing it in one native call) against the two-call path it replaced (`quantize`, then
`matmul_quantized` per weight), at every CPU level this machine runs:

- bit for bit equal, for every weight type, odd shapes (M = 1, 2, 3, 9, 17; N not a multiple
  of the tile; K one block and many), the GGUF layout and, where the build has it, the packed
  one; with one thread and two (the team splits the rows of every weight);
- several weights of mixed types and layouts into column slices of a strided output: each
  its own columns, nothing else written, x quantized once per kind;
- the plan and the kernel refuse bad arguments, a too-small scratch included.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from slotserve.models import native_build, native_qmatmul, native_qmatmul_plan, qmatmul_lib
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_qmatmul import KERNEL_TYPES, QuantWeight, qmatmul_available
from slotserve.models.native_qmatmul_plan import QMatmulPlan
from tests.checkpoint.gguf_convert import Q
from tests.models.test_qmatmul_int8 import lib_for, weight

TYPES = [Q(t) for t in KERNEL_TYPES]
LEVELS = native_build.supported_levels()


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: the quantized matmul kernel cannot be built")
    assert qmatmul_available(), "the quantized matmul kernel did not build"


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Run with this many threads, every product split (no work bar) when 2."""
    monkeypatch.setattr(native_qmatmul_plan, "PARALLEL_MIN_WORK", 0)
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def two_calls(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], w.n), float("nan"))
    w.matmul_quantized(w.quantize(x).clone(), out, 1)
    return out


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_one_call_equals_the_two_calls_bit_for_bit(level: native_build.CpuLevel, qtype: Q,
                                                   threads: int) -> None:
    lib = lib_for(level)
    block = GGML_QUANT_SIZES[qtype][0]
    for i, (m, n, blocks) in enumerate([(1, 1, 1), (2, 7, 3), (3, 13, 1), (9, 32, 2),
                                        (17, 48, 640 // block or 3), (1, 4101 // 16 * 16, 1)]):
        k = blocks * block
        data, _ = weight(qtype, n, k, seed=60 + i)
        plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        for w in {id(v): v for v in (plain, plain.repacked())}.values():
            out = torch.full((m, n), float("nan"))
            w.matmul(x, out)  # the one-call plan
            assert torch.equal(out, two_calls(w, x)), (
                f"{level.name} {qtype.name} {m}x{n}x{k} packed={w.packed} {threads} threads")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=["Q8_0", "Q4_K"])
def test_a_large_product_in_short_chunks_equals_the_two_calls(qtype: Q, threads: int) -> None:
    """64 x 6600 x 2048: more multiply-adds than q8call.h's Q8X_CHUNK_WORK allows a chunk of
    a few per thread, so its chunks are cut by work (and x is quantized in chunks, from 32
    rows); the last chunk is partial."""
    lib = native_qmatmul._library()
    m, n, k = 64, 6600, 2048
    data, _ = weight(qtype, n, k, seed=90)
    plain = QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    for w in {id(v): v for v in (plain, plain.repacked())}.values():
        out = torch.full((m, n), float("nan"))
        w.matmul(x, out)
        assert torch.equal(out, two_calls(w, x)), f"{qtype.name} packed={w.packed}"


def test_weights_of_mixed_types_share_one_call(threads: int) -> None:
    """A q/k/v-like list: Q5_0 (packed where the build has it), Q8_0 of 8 rows (too few to
    pack) and Q4_K, into column slices of a wider, row-strided output."""
    lib = native_qmatmul._library()
    k, m = 512, 5
    parts = [(Q.Q5_0, 32, 0), (Q.Q8_0, 8, 40), (Q.Q4_K, 16, 50)]  # (type, rows, column)
    weights = []
    for j, (qtype, n, _) in enumerate(parts):
        data, _ = weight(qtype, n, k, seed=70 + j)
        weights.append(QuantWeight(torch.from_numpy(data), int(qtype), k, lib=lib).repacked())
    plan = QMatmulPlan([(w, col) for w, (_, _, col) in zip(weights, parts, strict=True)], 66)
    x = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(7))[:, :k]  # strided
    wide = torch.full((m, 80), float("nan"))
    plan.run(x, wide[:, :66])
    for w, (_, n, col) in zip(weights, parts, strict=True):
        assert torch.equal(wide[:, col:col + n], two_calls(w, x.contiguous()))
    written = torch.zeros(80, dtype=torch.bool)
    for _, n, col in parts:
        written[col:col + n] = True
    assert wide[:, ~written].isnan().all(), "a column outside every weight was written"


def test_the_plan_refuses_bad_arguments() -> None:
    data, _ = weight(Q.Q8_0, 16, 64, seed=8)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), 64)
    other, _ = weight(Q.Q8_0, 16, 96, seed=9)
    with pytest.raises(NativeKernelError, match="one k"):
        QMatmulPlan([(w, 0), (QuantWeight(torch.from_numpy(other), int(Q.Q8_0), 96), 16)], 32)
    with pytest.raises(NativeKernelError, match="fit the output"):
        QMatmulPlan([(w, 8)], 16)
    with pytest.raises(NativeKernelError, match="weights per call"):
        QMatmulPlan([(w, 0)] * 9, 16)
    exact = QuantWeight(torch.from_numpy(data), int(Q.Q8_0), 64, int8=False)
    with pytest.raises(NativeKernelError, match="int8"):
        exact.plan()
    plan = w.plan()
    for x, out in [(torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2, 16)),
                   (torch.zeros(2, 64), torch.zeros(3, 16)),
                   (torch.zeros(2, 65), torch.zeros(2, 16)),
                   (torch.zeros(64, 2).t(), torch.zeros(2, 16))]:
        with pytest.raises(NativeKernelError, match="float32"):
            plan.run(x, out)


def test_the_kernel_checks_the_list_and_the_scratch_itself() -> None:
    lib = native_qmatmul._library()
    k, n, m = 64, 16, 2
    w = np.zeros((n, 68), dtype=np.uint8)
    x, y = np.zeros((m, k), np.float32), np.zeros((m, n), np.float32)
    seg = qmatmul_lib.QmmSeg(w.ctypes.data, n, 68, 0, int(Q.Q8_0), 0)
    need = lib.q8_x_scratch(ctypes.addressof(seg), 1, k, m)
    assert need == m * lib.act_row_bytes(lib.act_kind[int(Q.Q8_0)], k)
    scratch = np.zeros(need, np.uint8)

    def call(s: qmatmul_lib.QmmSeg, size: int = need, nseg: int = 1) -> int:
        return lib.q8_x(ctypes.addressof(s), nseg, k, x.ctypes.data, k, m, y.ctypes.data, n,
                        scratch.ctypes.data, size, 1)

    assert call(seg) == 0
    assert call(seg, need - 1) == 3
    assert call(seg, nseg=0) == 2 and call(seg, nseg=9) == 2
    bad = [qmatmul_lib.QmmSeg(w.ctypes.data, n, 68, 0, int(Q.Q2_K), 0),
           qmatmul_lib.QmmSeg(w.ctypes.data, n, 66, 0, int(Q.Q8_0), 0),
           qmatmul_lib.QmmSeg(w.ctypes.data, n, 68, 1, int(Q.Q8_0), 0)]
    assert [call(s) for s in bad] == [1, 2, 2]
    if not lib.repack_rows[int(Q.Q8_0)]:  # a build without the packed layout refuses it
        assert call(qmatmul_lib.QmmSeg(w.ctypes.data, n, 68, 0, int(Q.Q8_0), 1)) == 1


def test_helper_threads_survive_fork_and_concurrent_callers(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The pool's helpers are per process (a forked child, which has none of its parent's
    threads, starts its own) and a call that finds them busy with another thread's call runs
    alone: the same bits every way, and no call waits for a helper that does not exist."""
    import os
    import threading

    monkeypatch.setattr(native_qmatmul_plan, "PARALLEL_MIN_WORK", 0)
    k, n, m = 640, 1024, 3
    data, _ = weight(Q.Q5_0, n, k, seed=11)
    w = QuantWeight(torch.from_numpy(data), int(Q.Q5_0), k).repacked()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11))
    want = two_calls(w, x)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = torch.empty(m, n)
        w.matmul(x, got)  # the parent's helpers now exist
        assert torch.equal(got, want)
        outs = [torch.empty(m, n) for _ in range(4)]

        def many(out: torch.Tensor) -> None:
            for _ in range(50):
                w.matmul(x, out)

        runners = [threading.Thread(target=many, args=(o,)) for o in outs]
        for t in runners:
            t.start()
        for t in runners:
            t.join()
        assert all(torch.equal(o, want) for o in outs)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if its 2-thread result is right
            ok = False
            try:
                child = torch.empty(m, n)
                w.matmul(x, child)
                ok = torch.equal(child, want)
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(saved)
