"""The runner's slot table, per-slot buffers, KV cache sizing and contract errors."""

from __future__ import annotations

import logging

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from slotserve.errors import ConfigError, InvariantViolation, SlotOverflowError
from slotserve.model_config import ModelConfig
from slotserve.sampling_params import SamplingParams
from slotserve.worker.kv_cache import block_bytes, determine_num_blocks
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import ManualScheduler, TinyModel


def runner_for(model: TinyModel, max_num_seqs: int = 4, num_blocks: int | None = 64,
               kv_cache_memory: int | float | None = None) -> ModelRunner:
    if num_blocks is None:  # decided from the memory budget, as the engine's startup does
        num_blocks = determine_num_blocks(ModelConfig.from_pretrained(model.path), 4,
                                          torch.float32, torch.device("cpu"), None,
                                          kv_cache_memory, max_num_seqs, 64)
    return ModelRunner(model.path, SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64),
                       CacheConfig(block_size=4, num_blocks=num_blocks), device="cpu")


def new_req(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0,
            ) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=tokens, prefill_token_ids=tokens,
                          block_ids=blocks, num_computed_tokens=computed,
                          sampling_params=SamplingParams(temperature=0.0))


def step(new: list[NewRequestData] = (), cached: CachedRequestData | None = None,
         sched: dict[str, int] | None = None, finished: set[str] = frozenset(),
         preempted: set[str] = frozenset()) -> SchedulerOutput:
    sched = sched or {}
    return SchedulerOutput(scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=cached or CachedRequestData(),
                           num_scheduled_tokens=sched,
                           total_num_scheduled_tokens=sum(sched.values()),
                           finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def test_releases_apply_in_a_step_with_no_tokens(tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["llama"])
    out = runner.execute_model(step([new_req("a", [5, 6, 7], [1])], sched={"a": 3}))
    assert out.sampled_token_ids == [[out.sampled_token_ids[0][0]]]
    assert "a" in runner.slots and runner.last_forward_s > 0
    out = runner.execute_model(step(finished={"a"}))
    assert out.req_ids == [] and len(runner.slots) == 0 and runner.last_forward_s == 0.0


def test_same_id_readmission_replaces_stale_slot(tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["llama"], max_num_seqs=1)
    runner.execute_model(step([new_req("a", [5, 6, 7], [1])], sched={"a": 3}))
    # A resumed session comes back as a new request without a release first.
    out = runner.execute_model(step([new_req("a", [5, 6, 7, 8, 9], [1, 2], computed=3)],
                                    sched={"a": 2}))
    assert len(runner.slots) == 1 and len(out.sampled_token_ids[0]) == 1


def test_slot_overflow_is_typed(tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["llama"], max_num_seqs=1)
    runner.execute_model(step([new_req("a", [5], [1])], sched={"a": 1}))
    with pytest.raises(SlotOverflowError, match="No free indices.*'b'"):
        runner.execute_model(step([new_req("b", [5], [2])], sched={"b": 1}))


def test_cached_request_without_slot(tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["llama"])
    cached = CachedRequestData(req_ids=["ghost"], new_block_ids=[None], num_computed_tokens=[3])
    with pytest.raises(InvariantViolation, match="ghost"):
        runner.execute_model(step(cached=cached, sched={"ghost": 1}))


def test_scheduling_unknown_tokens_or_missing_blocks(tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["llama"])
    with pytest.raises(InvariantViolation, match="'a'.*knows 3 tokens"):
        runner.execute_model(step([new_req("a", [5, 6, 7], [1])], sched={"a": 4}))
    with pytest.raises(InvariantViolation, match="'b' has no KV block for position 4"):
        runner.execute_model(step([new_req("b", [5, 6, 7, 8, 9], [2])], sched={"b": 5}))


def test_null_block_never_written_and_decode_feeds_sampled_token(
        tiny_models: dict[str, TinyModel]) -> None:
    runner = runner_for(tiny_models["qwen3"])
    sched = ManualScheduler(block_size=4, num_blocks=64)
    for i in range(3):
        sched.add(f"r{i}", list(range(10 + i, 20 + 3 * i)), max_tokens=6)
    sched.run(runner, chunk=3)
    for k, v in runner.kv_caches:
        assert not k[0].any() and not v[0].any()
    slot_tokens = runner.batch.token_ids  # last occupant's row: prompt then its outputs
    req = sched.requests["r0"]
    assert len(runner.slots) == 0 and len(req.outputs) == 6
    assert any(row[: len(req.tokens)].tolist() == req.tokens for row in slot_tokens)


def test_num_blocks_from_memory_budget(tiny_models: dict[str, TinyModel],
                                       caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_models["llama"]
    per_block = block_bytes(ModelConfig.from_pretrained(model.path), 4, torch.float32)
    with caplog.at_level(logging.INFO, logger="slotserve.worker.kv_budget"):
        runner = runner_for(model, num_blocks=None, kv_cache_memory=per_block * 37 + 5)
    assert runner.num_blocks == 37
    assert runner.kv_caches[0][0].shape == (37, 4, 2, 16)
    assert "37 blocks" in caplog.text and "bytes requested" in caplog.text
    frac = runner_for(model, num_blocks=None, kv_cache_memory=1e-6)
    assert frac.num_blocks >= 2
    default = runner_for(model, num_blocks=None)
    assert default.num_blocks == 4 * 16 + 1  # every slot at max_model_len, plus null block
    with pytest.raises(ConfigError, match="too small"):
        runner_for(model, num_blocks=None, kv_cache_memory=per_block)


def test_bfloat16_runner_decodes(tiny_models: dict[str, TinyModel]) -> None:
    model = tiny_models["llama"]
    runner = ModelRunner(model.path, SchedulerConfig(max_num_seqs=4, max_model_len=64),
                         CacheConfig(block_size=4, num_blocks=64), dtype="bfloat16",
                         device="cpu")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    sched = ManualScheduler(block_size=4, num_blocks=64)
    sched.add("a", list(range(3, 15)), SamplingParams(temperature=0.0, logprobs=1),
              max_tokens=8)
    sched.run(runner)
    assert len(sched.requests["a"].outputs) == 8
    assert all(isinstance(v, float) for e in sched.requests["a"].logprobs for v in e.values())
