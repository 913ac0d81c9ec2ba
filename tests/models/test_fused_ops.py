"""The fused native layer ops (csrc/fused_ops.c) against their torch reference (models/fused.py).

Each op on odd shapes and strided rows: RMSNorm alone, after a residual add (Llama) and added
to the residual (Gemma 3), the gated activations, and the attention glue (q/k norm, RoPE, the
K/V cache write), and the step's RoPE rows. The cache rows the kernel writes are byte for
byte the reference's in every storage type; a slot outside the cache and a wrong tensor raise
NativeKernelError before anything is written. A whole model gives the same hidden states with
either set of ops, and picks the native one where it builds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slotserve.models import native_fused
from slotserve.models.attention import BatchLayout
from slotserve.models.fused import NATIVE_OPS, TORCH_OPS
from slotserve.models.gemma3 import GemmaRMSNorm
from slotserve.models.kv_storage import row_elems
from slotserve.models.layers import RMSNorm
from slotserve.models.native_attention import NativeKernelError, find_compiler
from tests.helpers import TinyModel
from tests.models.test_model_hf_equivalence import LOGPROB_TOL, make_prompts, make_runner

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def native() -> None:
    if find_compiler() is None:
        pytest.skip("no C compiler: the fused ops cannot be built")
    assert native_fused.native_fused_supported(torch.float32, CPU), "fused ops did not build"


def norm(cls: type[RMSNorm], d: int, seed: int) -> RMSNorm:
    n = cls(d, 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.rand(d, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return n


def rows(n: int, d: int, seed: int, strided: bool) -> torch.Tensor:
    """[n, d] with contiguous rows; strided: a column slice of a wider tensor."""
    x = torch.randn(n, d + 8 if strided else d, generator=torch.Generator().manual_seed(seed))
    return x[:, 3:3 + d] if strided else x


SHAPES = [(1, 640), (7, 48), (0, 16), (3, 1000)]


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("strided", [False, True])
def test_norms_equal_the_reference(n: int, d: int, cls: type[RMSNorm], strided: bool) -> None:
    w, w2 = norm(cls, d, 1), norm(cls, d, 2)
    x = rows(n, d, 3, strided)
    h = rows(n, d, 4, False)
    torch.testing.assert_close(NATIVE_OPS.norm(w, x), TORCH_OPS.norm(w, x), rtol=1e-6,
                               atol=1e-6)
    h_ref, h_nat = h.clone(), h.clone()
    torch.testing.assert_close(NATIVE_OPS.add_norm(h_nat, x, w),
                               TORCH_OPS.add_norm(h_ref, x, w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h_nat, h_ref, rtol=0, atol=0)  # the residual, exactly
    for nxt in (w2, None):
        h_ref, h_nat = h.clone(), h.clone()
        got, ref = NATIVE_OPS.norm_add(h_nat, x, w, nxt), TORCH_OPS.norm_add(h_ref, x, w, nxt)
        torch.testing.assert_close(h_nat, h_ref, rtol=1e-6, atol=1e-6)
        if nxt is None:
            assert got is None and ref is None
        else:
            assert got is not None and ref is not None
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("n,inter", [(1, 2048), (5, 24), (2, 7)])
def test_gated_activations_equal_the_reference(act: str, n: int, inter: int) -> None:
    gu = rows(n, 2 * inter, 5, False) * 4  # into the tails of both activations
    torch.testing.assert_close(NATIVE_OPS.gated_act(gu, act), TORCH_OPS.gated_act(gu, act),
                               rtol=2e-6, atol=2e-6)


class Attn:
    """The attributes the glue reads from an attention layer."""

    def __init__(self, heads: int, kv_heads: int, d: int, qk_norm: bool) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.qk_norm = qk_norm
        self.q_norm, self.k_norm = norm(GemmaRMSNorm, d, 6), norm(GemmaRMSNorm, d, 7)


def rope(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(n, 1, d // 2, generator=torch.Generator().manual_seed(seed)) * 6.28
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def caches(kv_dtype: torch.dtype, kv_heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (6, 4, kv_heads, row_elems(d, kv_dtype))
    return torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm", [(4, 1, 256, True), (6, 2, 32, False),
                                                      (3, 3, 16, True)])
def test_attention_glue_equals_the_reference(heads: int, kv_heads: int, d: int,
                                             qk_norm: bool) -> None:
    attn, n = Attn(heads, kv_heads, d, qk_norm), 5
    qkv = rows(n, (heads + 2 * kv_heads) * d, 8, False)
    cos, sin = rope(n, d, 9)
    slots = torch.tensor([3, 17, 0, 9, 23])
    ref_cache, nat_cache = caches(torch.float32, kv_heads, d), caches(torch.float32, kv_heads, d)
    ref = TORCH_OPS.qkv_rope_store(attn, qkv.clone(), cos, sin, ref_cache, slots)
    got = NATIVE_OPS.qkv_rope_store(attn, qkv.clone(), cos, sin, nat_cache, slots)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    for g, r in zip(nat_cache, ref_cache, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    assert nat_cache[0].view(-1, kv_heads, d)[17].abs().sum() > 0  # written where asked


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_cache_rows_are_the_references_bytes(kv_dtype: torch.dtype) -> None:
    """With no norm and the identity rotation, k and v reach the cache unchanged: the kernel's
    rows (int8: values and scale) equal kv_storage.write_kv's bit for bit."""
    heads, kv_heads, d, n = 2, 2, 64, 4
    attn = Attn(heads, kv_heads, d, qk_norm=False)
    qkv = rows(n, (heads + 2 * kv_heads) * d, 10, False) * 3
    qkv[0, heads * d] = 0.0  # a zero, and a whole zero row (scale 0) below
    qkv[1, (heads + kv_heads) * d:(heads + kv_heads + 1) * d] = 0.0
    cos, sin = torch.ones(n, 1, d), torch.zeros(n, 1, d)
    slots = torch.tensor([1, 2, 7, 22])
    ref_cache, nat_cache = caches(kv_dtype, kv_heads, d), caches(kv_dtype, kv_heads, d)
    TORCH_OPS.qkv_rope_store(attn, qkv.clone(), cos, sin, ref_cache, slots)
    NATIVE_OPS.qkv_rope_store(attn, qkv.clone(), cos, sin, nat_cache, slots)
    for g, r in zip(nat_cache, ref_cache, strict=True):
        assert torch.equal(g.view(torch.uint8), r.view(torch.uint8))


def test_bad_slot_and_bad_tensors_raise_before_writing() -> None:
    attn, n, d = Attn(2, 1, 16, qk_norm=True), 2, 16
    qkv = rows(n, 4 * d, 11, False)
    cos, sin = rope(n, d, 12)
    k_cache, v_cache = caches(torch.float32, 1, d)
    with pytest.raises(NativeKernelError, match="slot id is outside"):
        NATIVE_OPS.qkv_rope_store(attn, qkv, cos, sin, (k_cache, v_cache),
                                  torch.tensor([1, 24]))  # 6 blocks of 4: slots 0..23
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0
    with pytest.raises(NativeKernelError, match="slot_mapping"):
        NATIVE_OPS.qkv_rope_store(attn, qkv, cos, sin, (k_cache, v_cache),
                                  torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(NativeKernelError, match="caches"):
        NATIVE_OPS.qkv_rope_store(attn, qkv, cos, sin, (k_cache, v_cache.double()),
                                  torch.tensor([1, 2]))
    w = norm(RMSNorm, d, 13)
    with pytest.raises(NativeKernelError, match="float32 CPU"):
        NATIVE_OPS.norm(w, torch.randn(2, d, dtype=torch.float64))
    with pytest.raises(NativeKernelError, match="contiguous rows"):
        NATIVE_OPS.norm(w, torch.randn(d, 2).t())
    with pytest.raises(NativeKernelError, match="h must be"):
        NATIVE_OPS.add_norm(torch.randn(3, d), torch.randn(2, d), w)
    with pytest.raises(NativeKernelError, match="unknown activation"):
        NATIVE_OPS.gated_act(torch.randn(2, 8), "relu")


@pytest.mark.parametrize("half", [1, 32, 128])
def test_rope_rows_are_the_torch_forms_values(half: int) -> None:
    """The step's RoPE rows in one native call are the torch form's values bit for bit
    ((c, c) and (-s, s), negative zeros included), for any positions in any order; a position
    outside the tables raises IndexError as index_select does, and the native ops' rope_rows
    is that call."""
    g = torch.Generator().manual_seed(half)
    cos, sin = torch.randn(50, half, generator=g), torch.randn(50, half, generator=g)
    sin[3, 0] = 0.0  # -s of +0.0 is -0.0
    positions = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int64)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    ref = (torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1))
    got = native_fused.rope_rows(cos, sin, positions)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape == (5, 1, 2 * half) and a.is_contiguous()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(NATIVE_OPS.rope_rows(cos, sin, positions)[1].view(torch.int32),
                       ref[1].view(torch.int32))
    with pytest.raises(IndexError):
        native_fused.rope_rows(cos, sin, torch.tensor([2, 50]))
    with pytest.raises(IndexError):
        native_fused.rope_rows(cos, sin, torch.tensor([-1]))
    with pytest.raises(NativeKernelError, match="positions"):
        native_fused.rope_rows(cos, sin, torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_model_hidden_states_same_with_either_ops(tiny_models: dict[str, TinyModel],
                                                  name: str) -> None:
    """A prefill through the real runner's model: the native ops are chosen, and the torch
    ops (native=False) give the same logprobs to float rounding (decodes: the greedy tests
    of test_native_attention.py and test_model_hf_equivalence.py)."""
    results = []
    for native in (True, False):
        runner = make_runner(tiny_models[name], native=native)
        assert (runner.model.ops is NATIVE_OPS) == native
        assert all(m.ops is runner.model.ops for m in runner.model.modules()
                   if hasattr(m, "ops"))
        ids = torch.tensor(make_prompts()[6])
        n, bs = len(ids), runner.block_size
        nb = -(-n // bs)
        table = np.zeros((1, 64), dtype=np.int64)
        table[0, :nb] = np.arange(1, nb + 1)
        layout = BatchLayout(block_table=table, slots=np.array([0]), q_lens=np.array([n]),
                             num_computed=np.array([0]), num_decodes=0, block_size=bs,
                             slot_mapping=torch.arange(bs, bs + n))
        with torch.inference_mode():
            hidden = runner.model(ids, torch.arange(n), runner.kv_caches,
                                  runner.model.build_attention_metadata(layout))
            results.append(F.log_softmax(runner.model.compute_logits(hidden), -1))
    # Gemma 3's tiny model amplifies rounding differences (test_model_hf_equivalence).
    tol = LOGPROB_TOL.get(name, 1e-5)
    torch.testing.assert_close(results[0], results[1], rtol=tol, atol=tol)
