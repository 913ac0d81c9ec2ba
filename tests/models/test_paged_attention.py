"""The attention layer against dense attention computed from whole sequences.

Random K/V for every position of every request sit in shuffled cache blocks; one step mixes
decodes (short and long contexts), fresh prefills (shorter and longer than the window) and
chunks after a cached prefix. For full attention and for windows that start mid-block, inside
the last block, on a block boundary and beyond every context, each path (the torch path and
the native decode kernel) must give the dense result, with the cache stored in every
`--kv-cache-dtype` (of values that storage holds exactly).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slotserve.models.attention import AttentionBackend, BatchLayout, paged_attention
from slotserve.models.kv_storage import dequantize_rows, quantize_rows, row_elems, write_kv
from slotserve.models.native_attention import find_compiler

CPU = torch.device("cpu")
# (tokens already cached, tokens this step): decodes first, as the worker orders them.
STEP = [(0, 1), (4, 1), (9, 1), (40, 1), (0, 3), (0, 17), (8, 4), (13, 9), (30, 2)]


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float,
          window: int | None) -> torch.Tensor:
    """q [n, H, D] at positions first.., k/v [L, KVH, D] for positions 0..L-1 -> [n, H * D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = []
    for i in range(q.shape[0]):
        p = first + i
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k[lo:p + 1].double()) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v[lo:p + 1].double()))
    return torch.stack(out).reshape(q.shape[0], -1).float()


def stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache gives it back: values the storage type holds exactly."""
    if kv_dtype == torch.int8:
        return dequantize_rows(quantize_rows(x), x.shape[-1], torch.float32)
    return x.to(kv_dtype).float()


def run_step(native: bool, window: int | None, block_size: int, heads: int, kv_heads: int,
             head_dim: int, seed: int = 0, kv_dtype: torch.dtype = torch.float32,
             device: torch.device = CPU, step: list[tuple[int, int]] = STEP,
             num_decodes: int | None = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One mixed step through the attention layer on `device`: its outputs (on the CPU) and
    the dense references. `num_decodes`: how many leading requests form the decode group
    (default: the single-token ones)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [nc + n for nc, n in step]
    num_blocks = 1 + sum(math.ceil(n / block_size) for n in lens) + 5
    shape = (num_blocks, block_size, kv_heads, row_elems(head_dim, kv_dtype))
    k_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = np.zeros((len(step), 16), dtype=np.int64)
    queries, keys, values, slot_mapping, refs = [], [], [], [], []
    scale = head_dim ** -0.5
    for r, ((nc, n), length) in enumerate(zip(step, lens, strict=True)):
        nb = math.ceil(length / block_size)
        table[r, :nb], ids = ids[:nb], ids[nb:]
        k = stored(torch.randn(length, kv_heads, head_dim, generator=gen), kv_dtype)
        v = stored(torch.randn(length, kv_heads, head_dim, generator=gen), kv_dtype)
        q = torch.randn(n, heads, head_dim, generator=gen)
        pos = np.arange(length)
        slots = table[r, pos // block_size] * block_size + pos % block_size
        # The whole sequence: the cached prefix and this step's tokens (the layer writes
        # those before it attends).
        write_kv((k_cache, v_cache), k.to(device), v.to(device),
                 torch.from_numpy(slots).to(device))
        queries.append(q)
        keys.append(k[nc:])
        values.append(v[nc:])
        slot_mapping.append(torch.from_numpy(slots[nc:]))
        refs.append(dense(q, k, v, nc, scale, window))
    backend = AttentionBackend(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               windows=[None, window], dtype=torch.float32, device=device,
                               native=native)
    assert backend.native == native
    layout = BatchLayout(
        block_table=table, slots=np.arange(len(step)),
        q_lens=np.array([n for _, n in step]), num_computed=np.array([nc for nc, _ in step]),
        num_decodes=sum(n == 1 for _, n in step) if num_decodes is None else num_decodes,
        block_size=block_size,
        slot_mapping=torch.cat(slot_mapping).to(device))
    meta = backend.build(layout)[window]
    out = paged_attention(torch.cat(queries).to(device), torch.cat(keys).to(device),
                          torch.cat(values).to(device), (k_cache, v_cache), meta, scale)
    got = list(out.cpu().split([n for _, n in step]))
    return got, refs


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window", [None, 6, 3, 8, 1000])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(4, 4, 1, 32), (8, 6, 2, 16)])
def test_step_matches_dense_attention(native: bool, window: int | None, block_size: int,
                                      heads: int, kv_heads: int, head_dim: int) -> None:
    if native and find_compiler() is None:
        pytest.skip("no C compiler: the native decode kernel cannot be built")
    got, refs = run_step(native, window, block_size, heads, kv_heads, head_dim)
    for (nc, n), g, ref in zip(STEP, got, refs, strict=True):
        torch.testing.assert_close(g, ref, atol=2e-5, rtol=1e-5,
                                   msg=lambda m, nc=nc, n=n: f"({nc}, {n}): {m}")


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("window", [None, 6])
def test_each_kv_cache_dtype_matches_dense_attention(native: bool, kv_dtype: torch.dtype,
                                                     window: int | None) -> None:
    """Either path reads 16- and 8-bit cache rows (int8 with their scales) back to the values
    they stored: the dense result of those values, as tight as with a float32 cache."""
    if native and find_compiler() is None:
        pytest.skip("no C compiler: the native decode kernel cannot be built")
    got, refs = run_step(native, window, 4, 4, 2, 32, seed=5, kv_dtype=kv_dtype)
    for (nc, n), g, ref in zip(STEP, got, refs, strict=True):
        torch.testing.assert_close(g, ref, atol=2e-5, rtol=1e-5,
                                   msg=lambda m, nc=nc, n=n: f"({nc}, {n}): {m}")


# Two requests verifying drafts (3 and 5 query tokens) inside the decode group, as the worker
# places them: each query attends as the decode of its own position.
SPEC_STEP = [(4, 1), (9, 3), (40, 1), (30, 5), (0, 17), (8, 4)]


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_draft_rows_in_the_decode_group_match_dense_attention(native: bool,
                                                              window: int | None) -> None:
    if native and find_compiler() is None:
        pytest.skip("no C compiler: the native decode kernel cannot be built")
    got, refs = run_step(native, window, 4, 4, 2, 32, seed=3, step=SPEC_STEP, num_decodes=4)
    for (nc, n), g, ref in zip(SPEC_STEP, got, refs, strict=True):
        torch.testing.assert_close(g, ref, atol=2e-5, rtol=1e-5,
                                   msg=lambda m, nc=nc, n=n: f"({nc}, {n}): {m}")


def test_unbinding_window_shares_the_full_metadata() -> None:
    """A window no sequence outgrows this step changes nothing: the layers share one build."""
    backend = AttentionBackend(num_heads=2, num_kv_heads=1, head_dim=16, windows=[None, 64],
                               dtype=torch.float32, device=CPU, native=False)
    table = np.arange(1, 41, dtype=np.int64).reshape(2, 20)
    layout = BatchLayout(block_table=table, slots=np.arange(2), q_lens=np.array([1, 5]),
                         num_computed=np.array([20, 3]), num_decodes=1, block_size=4,
                         slot_mapping=torch.zeros(6, dtype=torch.int64))
    metas = backend.build(layout)
    assert metas[64] is metas[None] and metas[None].window is None
    layout.num_computed = np.array([70, 3])
    metas = backend.build(layout)
    assert metas[64] is not metas[None] and metas[64].window == 64
    # The windowed decode gathers only the blocks its window reaches: 64 tokens from
    # position 7 on lie in blocks 1..17 of its row (17 blocks), not all 18.
    assert metas[64].decode_max_blocks == 17 and metas[None].decode_max_blocks == 18
