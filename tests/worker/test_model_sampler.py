"""The sampler on plain vectors (against transformers' logits processors) and in the runner."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from slotserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_frequency_presence,
    apply_repetition_penalty,
    apply_top_k_top_p,
    mix_seed,
    row_argmax,
)
from tests.helpers import VOCAB, ManualScheduler, TinyModel

V = 50


def logits_batch(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_hf() -> None:
    logits = logits_batch()
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(1))
    for p in (1.3, 0.7):
        ref = RepetitionPenaltyLogitsProcessor(p)(ids, logits.clone())
        ours = apply_repetition_penalty(logits, ids, torch.full((4,), p))
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # Padding (= vocab size) is ignored, and a penalty of 1 changes nothing.
    padded = torch.cat([ids, torch.full((4, 5), V)], dim=1)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, padded, torch.full((4,), 1.3)),
                               ref, rtol=0, atol=0)
    assert torch.equal(apply_repetition_penalty(logits, ids, torch.ones(4)), logits)


def test_frequency_and_presence_penalties() -> None:
    logits = logits_batch(2)
    ids = torch.tensor([[3, 3, 5, V], [7, V, V, V]])
    out = apply_frequency_presence(logits, ids, torch.tensor([0.5, 0.0]),
                                   torch.tensor([0.25, 1.0]))
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.5 + 0.25
    expected[0, 5] -= 0.5 + 0.25
    expected[1, 7] -= 1.0
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("k", [1, 5, 17])
def test_top_k_matches_hf(k: int) -> None:
    logits = logits_batch()
    ref = TopKLogitsWarper(k)(None, logits.clone())
    ours = apply_top_k_top_p(logits, torch.full((4,), k), None)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_matches_hf(p: float) -> None:
    logits = logits_batch()
    ref = TopPLogitsWarper(p)(None, logits.clone())
    ours = apply_top_k_top_p(logits, None, torch.full((4,), p))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    both = apply_top_k_top_p(logits, torch.full((4,), 3), torch.full((4,), p))
    ref_both = TopPLogitsWarper(p)(None, TopKLogitsWarper(3)(None, logits.clone()))
    assert torch.equal(torch.isinf(both), torch.isinf(ref_both))


def test_mixed_rows_top_k_off_and_min_p() -> None:
    logits = logits_batch()
    ours = apply_top_k_top_p(logits, torch.tensor([0, 2, 0, 4]), None)
    assert torch.isinf(ours[0]).sum() == 0 and (~torch.isinf(ours[1])).sum() == 2
    sampler = Sampler(seed=0)
    meta = SamplingMetadata(temperature=torch.ones(4), all_greedy=False,
                            min_p=torch.full((4,), 0.2))
    ref_allowed = ~torch.isinf(MinPLogitsWarper(0.2)(None, logits.clone()))
    for _ in range(20):
        tokens = sampler(logits, meta).sampled
        assert ref_allowed[torch.arange(4), tokens].all()


def test_sampling_follows_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-12]]))
    sampler = Sampler(seed=0)
    meta = SamplingMetadata(temperature=torch.ones(2000), all_greedy=False)
    tokens = sampler(logits.expand(2000, -1), meta).sampled
    freq = torch.bincount(tokens, minlength=4).float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.04, rtol=0)


def test_greedy_rows_in_a_random_batch_take_argmax() -> None:
    logits = logits_batch()
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 0.0, 5.0]), all_greedy=False)
    out = Sampler(seed=0)(logits, meta).sampled
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_row_argmax_is_torchs_argmax_on_ties_nan_and_strides() -> None:
    """The numpy path picks what torch.argmax picks: the first of tied maxima, a NaN over
    any number, index 0 of an all -inf row (a grammar that allows nothing), strided rows."""
    x = logits_batch(6, seed=3)
    x[0, 7] = x[0, 30] = 100.0
    x[1, 4] = x[1, 9] = float("nan")
    x[2] = float("-inf")
    x[3, 12] = float("inf")
    x[4, 20] = float("inf")
    x[4, 41] = float("nan")
    for m in (x, x[:, ::3], x.T.contiguous().T, torch.randn(32, 262_144)):
        assert torch.equal(row_argmax(m), m.argmax(dim=-1))
    half = x.to(torch.bfloat16)  # not float32: torch's own
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))


def test_min_tokens_masks_stop_ids() -> None:
    logits = logits_batch(2)
    top = logits.argmax(dim=-1)
    meta = SamplingMetadata(temperature=torch.zeros(2), all_greedy=True,
                            masked_rows=torch.tensor([0]), masked_tokens=top[:1])
    out = Sampler(seed=0)(logits, meta).sampled
    assert out[0] != top[0] and out[1] == top[1]


def test_mix_seed_distinct() -> None:
    seeds = {mix_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)


# ------------------------------------------------------------------ in the runner


def make_runner(model: TinyModel, max_num_seqs: int = 8) -> ModelRunner:
    return ModelRunner(model.path, SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=128),
                       CacheConfig(block_size=4, num_blocks=256), device="cpu")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_request_same_alone_in_batch_and_after_preemption(
        tiny_models: dict[str, TinyModel]) -> None:
    model = tiny_models["llama"]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)

    alone = ManualScheduler()
    alone.add("s", prompt(9, 0), seeded, max_tokens=24)
    alone.run(make_runner(model))

    crowd = ManualScheduler()
    for i in range(5):
        crowd.add(f"o{i}", prompt(3 + 4 * i, i + 10),
                  SamplingParams(temperature=0.8, top_k=20, max_tokens=24), max_tokens=24)
    crowd.add("s", prompt(9, 0), seeded, max_tokens=24)
    crowd.run(make_runner(model), chunk=4)

    preempted = ManualScheduler()
    preempted.add("s", prompt(9, 0), seeded, max_tokens=24)
    preempted.add("x", prompt(5, 3), SamplingParams(temperature=1.0, max_tokens=24),
                  max_tokens=24)
    runner = make_runner(model)
    for _ in range(8):
        preempted.update(runner.execute_model(preempted.schedule()))
    preempted.preempt("s")
    preempted.run(runner, chunk=5)

    tokens = alone.requests["s"].outputs
    assert len(set(tokens)) > 3  # really sampled, not stuck
    assert crowd.requests["s"].outputs == tokens
    assert preempted.requests["s"].outputs == tokens
    other = ManualScheduler()
    other.add("s", prompt(9, 0), seeded.clone(seed=99), max_tokens=24)
    other.run(make_runner(model))
    assert other.requests["s"].outputs != tokens


def test_min_tokens_in_runner(tiny_models: dict[str, TinyModel]) -> None:
    model = tiny_models["mistral"]
    p = prompt(6, 5)
    greedy = ManualScheduler()
    greedy.add("g", p, SamplingParams(temperature=0.0), max_tokens=6)
    greedy.run(make_runner(model))
    free = greedy.requests["g"].outputs
    # Make the 1st and 3rd greedy tokens "EOS" / a stop token: below min_tokens=3 they are
    # masked, so the output must differ at step 0; with min_tokens=0 it must not.
    eos, stop = free[0], free[2]
    masked = ManualScheduler()
    masked.add("m", p, SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
               max_tokens=6, eos_token_id=eos)
    unmasked = ManualScheduler()
    unmasked.add("u", p, SamplingParams(temperature=0.0), max_tokens=6, eos_token_id=eos)
    runner = make_runner(model)
    masked.run(runner)
    unmasked.run(runner)
    out = masked.requests["m"].outputs
    assert out[0] != eos and eos not in out[:3] and stop not in out[:3]
    assert unmasked.requests["u"].outputs == free


def test_logprobs_are_raw_under_temperature_and_penalties(
        tiny_models: dict[str, TinyModel]) -> None:
    model = tiny_models["qwen2"]
    sched = ManualScheduler()
    p = prompt(10, 7)
    sched.add("r", p, SamplingParams(temperature=0.5, repetition_penalty=1.5,
                                     presence_penalty=0.5, logprobs=4, seed=3), max_tokens=8)
    sched.run(make_runner(model))
    req = sched.requests["r"]
    with torch.inference_mode():
        logits = model.hf(torch.tensor([p + req.outputs])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    for step, (tok, entry) in enumerate(zip(req.outputs, req.logprobs, strict=True)):
        row = raw[len(p) - 1 + step]
        assert abs(entry[tok] - row[tok].item()) < 1e-4
        top = row.topk(4)
        assert set(top.indices.tolist()) <= set(entry)
        assert len(entry) in (4, 5)


def test_repetition_penalty_in_runner_matches_hf_processor(
        tiny_models: dict[str, TinyModel]) -> None:
    """Greedy with a repetition penalty equals HF greedy with the same processor."""
    model = tiny_models["llama_tied"]
    p = prompt(8, 11)
    sched = ManualScheduler()
    sched.add("r", p, SamplingParams(temperature=0.0, repetition_penalty=1.8), max_tokens=16)
    sched.run(make_runner(model))
    with torch.inference_mode():
        ref = model.hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                dtype=torch.long), max_new_tokens=16, do_sample=False,
                                repetition_penalty=1.8)[0, len(p):].tolist()
    assert sched.requests["r"].outputs == ref
