"""slotserve's runner against Hugging Face transformers on tiny random models.

Greedy tokens must be identical and sampled-token logprobs within 1e-4, whether the prompts
are prefilled whole, in chunks (later chunks attend to a cached prefix) or in steps that mix
chunked prefills with decodes.
"""

from __future__ import annotations

import math

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import VOCAB, ManualScheduler, TinyModel, hf_greedy

NEW_TOKENS = 32
PROMPT_LENS = [1, 3, 7, 12, 17, 24, 33, 45]


def make_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def make_runner(model: TinyModel, block_size: int = 4, max_num_seqs: int = 8,
                max_model_len: int = 128) -> ModelRunner:
    return ModelRunner(model.path, SchedulerConfig(max_num_seqs=max_num_seqs,
                                                   max_model_len=max_model_len),
                       CacheConfig(block_size=block_size, num_blocks=512), dtype="float32",
                       device="cpu")


@pytest.fixture(scope="module")
def hf_references(tiny_models: dict[str, TinyModel]) -> dict[str, list]:
    prompts = make_prompts()
    return {name: [hf_greedy(m.hf, p, NEW_TOKENS) for p in prompts]
            for name, m in tiny_models.items()}


def check_against_hf(sched: ManualScheduler, refs: list, num_logprobs: int) -> None:
    for i, (hf_tokens, hf_logprobs) in enumerate(refs):
        req = sched.requests[f"r{i}"]
        assert req.outputs == hf_tokens, f"prompt {i} ({PROMPT_LENS[i]} tokens) diverged"
        assert len(req.logprobs) == NEW_TOKENS
        for step, (tok, entry) in enumerate(zip(req.outputs, req.logprobs, strict=True)):
            ref = hf_logprobs[step]
            assert abs(entry[tok] - ref[tok].item()) < 1e-4
            top = ref.topk(num_logprobs)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[t] - v) < 1e-4
            assert all(isinstance(v, float) for v in entry.values())


@pytest.mark.parametrize("chunk", [None, 5])
def test_greedy_matches_hf(tiny_model: TinyModel, hf_references: dict[str, list],
                           chunk: int | None) -> None:
    runner = make_runner(tiny_model)
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(make_prompts()):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=chunk)
    check_against_hf(sched, hf_references[tiny_model.name], num_logprobs=3)
    assert len(runner.slots) == 0


def test_mixed_step_prefix_chunk_with_decodes(tiny_models: dict[str, TinyModel],
                                              hf_references: dict[str, list]) -> None:
    """One request prefills a chunk after its cached prefix while the others decode."""
    model = tiny_models["llama"]
    runner = make_runner(model, block_size=4)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=NEW_TOKENS)
    for i in (0, 1, 2):
        sched.add(f"r{i}", prompts[i], params, max_tokens=NEW_TOKENS)
    long = sched.add("r7", prompts[7], params, max_tokens=NEW_TOKENS)
    # Step 1: everyone's first chunk (the short prompts finish their prefill).
    out = runner.execute_model(sched.schedule(chunk=10))
    sched.update(out)
    assert out.sampled_token_ids[out.req_id_to_index["r7"]] == []
    # Steps 2..: r7 prefills 10 tokens at a time after its cached prefix, mixed with decodes.
    mixed_steps = 0
    while long.num_computed < len(long.prompt):
        so = sched.schedule(chunk=10)
        assert so.num_scheduled_tokens["r7"] > 1 and so.num_scheduled_tokens["r0"] == 1
        mixed_steps += 1
        sched.update(runner.execute_model(so))
    assert mixed_steps >= 3
    sched.run(runner, chunk=10)
    refs = hf_references["llama"]
    for i in (0, 1, 2, 7):
        assert sched.requests[f"r{i}"].outputs == refs[i][0]
        for tok, entry, ref in zip(sched.requests[f"r{i}"].outputs,
                                   sched.requests[f"r{i}"].logprobs, refs[i][1], strict=True):
            assert math.isclose(entry[tok], ref[tok].item(), abs_tol=1e-4)


def test_decode_after_preemption_recompute(tiny_models: dict[str, TinyModel],
                                           hf_references: dict[str, list]) -> None:
    """A preempted request comes back with prompt + outputs as prefill and continues exactly."""
    model = tiny_models["qwen3"]
    runner = make_runner(model)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i in (3, 5):
        sched.add(f"r{i}", prompts[i], params, max_tokens=NEW_TOKENS)
    for _ in range(10):
        sched.update(runner.execute_model(sched.schedule()))
    sched.preempt("r5")
    sched.update(runner.execute_model(sched.schedule(only={"r3"})))
    assert "r5" not in runner.slots
    sched.run(runner, chunk=6)
    refs = hf_references["qwen3"]
    assert sched.requests["r3"].outputs == refs[3][0]
    assert sched.requests["r5"].outputs == refs[5][0]
