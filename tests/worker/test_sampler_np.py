"""The torch-free sampler against the torch one, on the same arrays: the same greedy picks and
logprobs under every option, the same tokens left by the filters, seeded draws independent of
the batch, draws that follow the distribution, and no torch in its imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slotserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_frequency_presence,
    apply_grammar_bias,
    apply_repetition_penalty,
    apply_top_k_top_p,
    grammar_bias,
)
from slotserve.worker.sampler_np import (
    NumpySampler,
    apply_frequency_presence as np_frequency_presence,
    apply_grammar_bitmask,
    apply_repetition_penalty as np_repetition_penalty,
    filtered_logits,
)
from slotserve.worker.sampling_arrays import F32, I64, SamplingArrays

V = 300


def make_logits(rows: int, vocab: int = V, seed: int = 0) -> F32:
    return (np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32) * 3)


def packed_bitmask(allowed: np.ndarray) -> np.ndarray:
    """[M, V] bool -> packed int32 rows (bit i of word w: token 32w + i)."""
    words = -(-allowed.shape[1] // 32)
    padded = np.zeros((allowed.shape[0], words * 32), dtype=bool)
    padded[:, :allowed.shape[1]] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<i4")


def to_meta(a: SamplingArrays, vocab: int) -> SamplingMetadata:
    """The torch sampler's metadata from tensors of the same arrays."""

    def opt(x: np.ndarray | None) -> torch.Tensor | None:
        return None if x is None else torch.from_numpy(np.ascontiguousarray(x))

    return SamplingMetadata(
        temperature=torch.from_numpy(a.temperature), all_greedy=a.all_greedy,
        top_k=opt(a.top_k), top_p=opt(a.top_p), min_p=opt(a.min_p), row_seeds=a.row_seeds,
        repetition_penalty=opt(a.repetition_penalty), frequency_penalty=opt(a.frequency_penalty),
        presence_penalty=opt(a.presence_penalty), prompt_output_ids=opt(a.prompt_output_ids),
        output_ids=opt(a.output_ids), masked_rows=opt(a.masked_rows),
        masked_tokens=opt(a.masked_tokens), bias_rows=opt(a.bias_rows),
        bias_tokens=opt(a.bias_tokens), bias_values=opt(a.bias_values),
        max_num_logprobs=a.max_num_logprobs, grammar_rows=opt(a.grammar_rows),
        grammar_bias=(None if a.grammar_bitmask is None
                      else grammar_bias(a.grammar_bitmask, vocab, torch.device("cpu"))))


def every_option(rows: int, grammar: str, greedy: bool, seed: int = 0) -> SamplingArrays:
    """Bias (with a duplicate pair), min_tokens masks, all three penalties and a grammar."""
    rng = np.random.default_rng(seed + 100)
    a = SamplingArrays(
        temperature=np.zeros(rows, np.float32) if greedy
        else np.where(np.arange(rows) % 2 == 0, 0.0, 0.8).astype(np.float32),
        all_greedy=greedy, max_num_logprobs=5)
    a.bias_rows = np.array([0, 0, 1, 2, rows - 1], np.int64)
    a.bias_tokens = np.array([7, 7, 11, 3, 250], np.int64)
    a.bias_values = np.array([4.0, 3.5, -2.0, 9.0, 6.0], np.float32)
    a.masked_rows = np.array([1, 3, 3], np.int64)
    a.masked_tokens = np.array([5, 6, 7], np.int64)
    a.repetition_penalty = rng.uniform(0.7, 1.8, rows).astype(np.float32)
    a.prompt_output_ids = rng.integers(0, V + 1, (rows, 40)).astype(np.int64)
    a.frequency_penalty = rng.uniform(-0.5, 1.0, rows).astype(np.float32)
    a.presence_penalty = rng.uniform(-0.5, 1.0, rows).astype(np.float32)
    a.output_ids = rng.integers(0, 20, (rows, 15)).astype(np.int64)  # repeats
    a.output_ids[:, -3:] = V  # padding
    if grammar != "none":
        m = rows if grammar == "all" else rows // 2
        a.grammar_bitmask = packed_bitmask(rng.random((m, V)) < 0.5)
        if grammar == "rows":
            a.grammar_rows = np.sort(rng.choice(rows, m, replace=False)).astype(np.int64)
    return a


@pytest.mark.parametrize("grammar", ["none", "all", "rows"])
@pytest.mark.parametrize("greedy", [True, False])
def test_greedy_and_logprobs_match_torch_under_every_option(grammar: str, greedy: bool) -> None:
    rows = 6
    logits = make_logits(rows, seed=1)
    arrays = every_option(rows, grammar, greedy)
    ref = Sampler(seed=0)(torch.from_numpy(logits.copy()), to_meta(arrays, V))
    out = NumpySampler(seed=0)(logits.copy(), arrays)
    greedy_rows = arrays.temperature < 1e-5
    assert greedy_rows.sum() >= 3
    assert np.array_equal(out.sampled[greedy_rows], ref.sampled.numpy()[greedy_rows])
    assert out.topk_ids is not None and out.topk_logprobs is not None
    assert ref.topk_ids is not None and ref.topk_logprobs is not None
    assert np.array_equal(out.topk_ids, ref.topk_ids.numpy())
    np.testing.assert_allclose(out.topk_logprobs, ref.topk_logprobs.numpy(), rtol=0, atol=1e-5)
    # The sampled token's raw logprob, at this sampler's own picks for the random rows.
    raw = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    if arrays.grammar_bitmask is not None:
        meta = to_meta(arrays, V)
        assert meta.grammar_bias is not None
        raw = torch.log_softmax(apply_grammar_bias(torch.from_numpy(logits.copy()),
                                                   meta.grammar_rows, meta.grammar_bias), -1)
    assert out.sampled_logprobs is not None
    np.testing.assert_allclose(out.sampled_logprobs,
                               raw[torch.arange(rows), torch.from_numpy(out.sampled)].numpy(),
                               rtol=0, atol=1e-5)


def test_logprobs_on_a_large_vocabulary() -> None:
    """At 262k tokens torch's float32 sum is off by up to 2e-5; this log-softmax stays within
    2e-6 of float64."""
    logits = make_logits(4, 262_144, seed=2) * 2
    arrays = SamplingArrays(temperature=np.zeros(4, np.float32), all_greedy=True,
                            max_num_logprobs=20)
    ref = Sampler(seed=0)(torch.from_numpy(logits.copy()), to_meta(arrays, 262_144))
    out = NumpySampler(seed=0)(logits.copy(), arrays)
    assert out.topk_ids is not None and out.topk_logprobs is not None
    assert out.sampled_logprobs is not None
    assert ref.topk_ids is not None and ref.topk_logprobs is not None
    assert np.array_equal(out.sampled, ref.sampled.numpy())
    assert np.array_equal(out.topk_ids, ref.topk_ids.numpy())
    np.testing.assert_allclose(out.topk_logprobs, ref.topk_logprobs.numpy(), rtol=0, atol=5e-5)
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    exact = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    rows = np.arange(4)[:, None]
    np.testing.assert_allclose(out.topk_logprobs, exact[rows, out.topk_ids], rtol=0, atol=5e-6)
    np.testing.assert_allclose(out.sampled_logprobs, exact[rows[:, 0], out.sampled], rtol=0,
                               atol=5e-6)


def test_penalties_and_grammar_are_torchs_bits() -> None:
    rows, vocab = 5, 77  # not a multiple of 32
    logits = make_logits(rows, vocab, seed=3)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, vocab + 1, (rows, 30)).astype(np.int64)
    pen = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    freq, pres = (rng.uniform(-1, 1, rows).astype(np.float32) for _ in range(2))
    t = torch.from_numpy
    ours = logits.copy()
    np_repetition_penalty(ours, ids, pen)
    assert np.array_equal(ours, apply_repetition_penalty(t(logits), t(ids), t(pen)).numpy())
    ours = logits.copy()
    np_frequency_presence(ours, ids, freq, pres)
    ref = apply_frequency_presence(t(logits), t(ids), t(freq), t(pres)).numpy()
    assert np.array_equal(ours, ref)
    allowed = rng.random((3, vocab)) < 0.3
    grammar_rows = np.array([4, 0, 2], np.int64)
    ours = logits.copy()
    apply_grammar_bitmask(ours, grammar_rows, packed_bitmask(allowed))
    bias = grammar_bias(packed_bitmask(allowed), vocab, torch.device("cpu"))
    assert np.array_equal(ours, apply_grammar_bias(t(logits.copy()), t(grammar_rows),
                                                   bias).numpy())
    assert np.array_equal(np.isfinite(ours[grammar_rows]), allowed)


def torch_filtered(logits: F32, a: SamplingArrays) -> np.ndarray:
    """The torch sampler's filtering (`Sampler._sample` up to its softmax)."""
    x = torch.from_numpy(logits.copy())
    temp = torch.from_numpy(a.temperature)
    x = x / torch.where(temp < 1e-5, 1.0, temp).unsqueeze(1)
    if a.min_p is not None:
        probs = x.softmax(dim=-1)
        threshold = torch.from_numpy(a.min_p).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < threshold, float("-inf"))
    top_k = None if a.top_k is None else torch.from_numpy(a.top_k)
    top_p = None if a.top_p is None else torch.from_numpy(a.top_p)
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p(x, top_k, top_p)
    return x.numpy()


def filter_arrays(rows: int, top_k: bool, top_p: bool, min_p: bool, seed: int) -> SamplingArrays:
    """Per-row values, some rows off (k = 0, p = 1, min_p = 0), one greedy (temperature 1)."""
    rng = np.random.default_rng(seed)
    temp = rng.uniform(0.3, 2.0, rows).astype(np.float32)
    temp[0] = 0.0
    a = SamplingArrays(temperature=temp, all_greedy=False)
    if top_k:
        a.top_k = rng.integers(1, 40, rows).astype(np.int64)
        a.top_k[1] = 0
    if top_p:
        a.top_p = rng.uniform(0.05, 0.99, rows).astype(np.float32)
        a.top_p[2] = 1.0
    if min_p:
        a.min_p = rng.uniform(0.0, 0.3, rows).astype(np.float32)
        a.min_p[3] = 0.0
    return a


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (True, False, False), (False, True, False), (False, False, True), (True, True, False),
    (True, True, True), (False, True, True)])
@pytest.mark.parametrize("vocab", [50, 5000, 65536])
def test_filters_leave_torchs_tokens(top_k: bool, top_p: bool, min_p: bool, vocab: int) -> None:
    for seed in range(5):
        logits = make_logits(8, vocab, seed=seed)
        arrays = filter_arrays(8, top_k, top_p, min_p, seed)
        ours = filtered_logits(logits.copy(), arrays)
        ref = torch_filtered(logits, arrays)
        assert np.array_equal(np.isfinite(ours), np.isfinite(ref)), seed
        kept = np.isfinite(ours)
        np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6)
        assert kept.sum(axis=1).min() >= 1


def test_top_p_tie_on_the_cut_keeps_torchs_count() -> None:
    # Four equal tokens hold 0.2 each; p = 0.5 cuts through them (torch's unstable sort picks
    # which of them survive; the count is fixed).
    x = np.log(np.array([[0.2, 0.05, 0.2, 0.1, 0.2, 0.05, 0.2]], np.float32))
    arrays = SamplingArrays(temperature=np.ones(1, np.float32), all_greedy=False,
                            top_p=np.full(1, 0.5, np.float32))
    ours = filtered_logits(x.copy(), arrays)
    ref = torch_filtered(x, arrays)
    assert np.isfinite(ours).sum() == np.isfinite(ref).sum() == 3
    assert np.array_equal(np.flatnonzero(np.isfinite(ours[0])), [2, 4, 6])


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_seeded_row_is_independent_of_the_batch(top_p: float | None) -> None:
    logits = make_logits(5, 4000, seed=4) * 0.3  # flat: many tokens in play

    def draw(rows: list[int], seeds: dict[int, int], sampler: NumpySampler) -> I64:
        a = SamplingArrays(temperature=np.ones(len(rows), np.float32), all_greedy=False,
                           row_seeds=seeds)
        if top_p is not None:
            a.top_p = np.full(len(rows), top_p, np.float32)
        return sampler(logits[rows].copy(), a).sampled

    sampler = NumpySampler(seed=1)
    alone = draw([2], {0: 77}, sampler)[0]
    assert draw([0, 1, 2, 3], {2: 77}, sampler)[2] == alone
    assert draw([4, 2], {0: 5, 1: 77}, NumpySampler(seed=9))[1] == alone
    assert draw([2], {0: 77}, NumpySampler())[0] == alone
    assert len({int(draw([2], {0: s}, sampler)[0]) for s in range(50)}) > 10
    # Unseeded rows draw on from the sampler's generator.
    assert len({int(t) for t in draw([2] * 50, {}, sampler)}) > 10


@pytest.mark.parametrize("top_p", [None, 0.8])
def test_draws_follow_the_distribution(top_p: float | None) -> None:
    logits = np.array([[1.0, 0.5, 0.0, -1.0, -4.0]], np.float32)
    temp, n = 0.7, 6000
    a = SamplingArrays(temperature=np.full(n, temp, np.float32), all_greedy=False)
    probs = np.exp(logits[0] / temp) / np.exp(logits[0] / temp).sum()
    if top_p is not None:
        a.top_p = np.full(n, top_p, np.float32)
        keep = np.cumsum(np.sort(probs)) > 1 - top_p
        probs = np.where(probs >= np.sort(probs)[keep][0], probs, 0)
        probs /= probs.sum()
    tokens = NumpySampler(seed=0)(np.repeat(logits, n, axis=0), a).sampled
    freq = np.bincount(tokens, minlength=5) / n
    np.testing.assert_allclose(freq, probs, atol=0.025, rtol=0)


def test_grammar_disallowed_token_never_sampled() -> None:
    rows, n = 4, 64
    rng = np.random.default_rng(5)
    allowed = rng.random((2, V)) < 0.02
    allowed[:, 0] = True
    logits = make_logits(rows, seed=5)
    logits[:, ~allowed[0]] += 20  # the grammar must beat the most likely tokens
    grammar_rows = np.array([1, 3], np.int64)
    for step in range(n):
        a = SamplingArrays(temperature=np.array([1.5, 1.5, 0.0, 2.0], np.float32),
                           all_greedy=False, top_k=np.array([0, 50, 0, 0], np.int64),
                           top_p=np.array([1.0, 0.9, 1.0, 0.95], np.float32),
                           grammar_rows=grammar_rows, grammar_bitmask=packed_bitmask(allowed),
                           max_num_logprobs=V // 2, row_seeds={3: step})
        out = NumpySampler(seed=step)(logits.copy(), a)
        assert allowed[np.arange(2), out.sampled[grammar_rows]].all()
    assert out.topk_ids is not None and out.topk_logprobs is not None
    for j, row in enumerate(grammar_rows):
        finite = np.isfinite(out.topk_logprobs[row])
        assert finite.sum() == allowed[j].sum() < V // 2
        assert allowed[j, out.topk_ids[row][finite]].all()
        assert (out.topk_logprobs[row][~finite] == -np.inf).all()


def test_import_without_torch() -> None:
    code = "import sys, slotserve.worker.sampler_np; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])
