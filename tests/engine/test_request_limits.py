"""What one request may carry (issue 11, items 1, 3, 8, 9): every number fits what the worker
holds it in, every list is bounded, per-token stop checks are O(1) in the stop list's size,
client priority is bounded and refused under FCFS, an empty prompt or first chunk is refused
before tokenization, and a session takes no input after its end."""

from __future__ import annotations

from typing import Any

import pytest

from slotserve.core.request import Request, RequestStatus
from slotserve.core.sched_utils import check_stop
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.processor import MAX_PRIORITY, Processor
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from tests.helpers import TOKENIZER_EOS as EOS, bounded


@pytest.fixture
def processor(tokenizer: Any) -> Processor:
    return Processor(tokenizer, max_model_len=64, vocab_size=len(tokenizer), eos_token_ids=[EOS])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e6}, "temperature"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_numbers_and_lists_out_of_bounds(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_bounds_are_inclusive() -> None:
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), seed=2**63 - 1,
                   temperature=100.0, logit_bias={i: -100 for i in range(MAX_LOGIT_BIAS)},
                   stop=["x" * MAX_STOP_STRING_CHARS], repetition_penalty=0.01)


def test_top_k_is_clamped_to_the_vocabulary(processor: Processor) -> None:
    vocab = processor.vocab_size
    for top_k, expect in ((vocab - 1, vocab - 1), (vocab, 0), (2**62, 0), (5, 5)):
        p = processor.process("a", "To be", SamplingParams(top_k=top_k))
        assert p.requests[0].sampling_params.top_k == expect


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_ids_outside_the_vocabulary(processor: Processor, field: str) -> None:
    bad = processor.vocab_size
    value: Any = [bad] if field == "stop_token_ids" else {bad: 1.0}
    with pytest.raises(RequestValidationError, match="out of range") as e:
        processor.process("a", "To be", SamplingParams(**{field: value}))
    assert e.value.param == field


class _NoScan(list):  # type: ignore[type-arg]
    def __contains__(self, item: object) -> bool:
        raise AssertionError("the stop list was scanned")

    def __iter__(self):  # noqa: ANN204
        raise AssertionError("the stop list was scanned")


def test_per_token_stop_check_never_scans_the_list() -> None:
    params = SamplingParams(stop_token_ids=list(range(1000, 1000 + MAX_STOP_TOKEN_IDS)),
                            max_tokens=100)
    params.stop_token_ids = _NoScan(params.stop_token_ids)
    r = Request("r", [1, 2, 3], params, eos_token_id=2)
    r.status = RequestStatus.RUNNING
    for t in (5, 6, 7):
        r.append_output_token_ids(t)
        assert not check_stop(r, 1 << 20)
    r.append_output_token_ids(1000 + MAX_STOP_TOKEN_IDS - 1)
    assert check_stop(r, 1 << 20) and r.stop_reason == 1000 + MAX_STOP_TOKEN_IDS - 1


def test_priority_refused_under_fcfs_and_bounded(tokenizer: Any, processor: Processor) -> None:
    with pytest.raises(RequestValidationError, match="--policy priority") as e:
        processor.process("a", "To be", None, priority=-5)
    assert e.value.param == "priority"
    processor.process("a", "To be", None, priority=0)
    prio = Processor(tokenizer, 64, len(tokenizer), [EOS], priority_policy=True)
    assert prio.process("a", "To be", None, priority=-5).requests[0].priority == -5
    with pytest.raises(RequestValidationError, match="priority must be in"):
        prio.process("a", "To be", None, priority=MAX_PRIORITY + 1)


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt_refused_before_tokenization(processor: Processor, prompt: Any) -> None:
    # The tokenizer would turn "" into [BOS]; the rule is on what the caller sent.
    with pytest.raises(RequestValidationError, match="empty") as e:
        processor.process("a", prompt, None)
    assert e.value.param == "prompt"


def test_empty_first_chunk_refused_later_chunks_may_be_empty(processor: Processor) -> None:
    for empty in ("", []):
        with pytest.raises(RequestValidationError, match="empty"):
            processor.tokenize_chunk(empty, first=True)
        assert processor.tokenize_chunk(empty, first=False) == []
    p = processor.process("s", {"prompt_token_ids": []}, None, resumable=True,
                          continuation_of=10)
    assert p.requests[0].prompt_token_ids == []


def test_session_takes_no_input_after_its_end() -> None:
    engine = LLMEngine.from_engine_args(device="cpu", dtype="float32", max_model_len=64,
                                        num_blocks=16, max_num_seqs=2, check=True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": [1, 5, 6]}, params, resumable=True)
    engine.add_request("s", {"prompt_token_ids": []}, None)  # the end mark
    for args in (({"prompt_token_ids": [7]}, params), ({"prompt_token_ids": []}, None)):
        with pytest.raises(RequestValidationError, match="ended") as e:
            engine.add_request("s", args[0], args[1], resumable=args[1] is not None)
        assert e.value.param == "request_id"
    outs = []
    for _ in bounded(engine.has_unfinished_requests):
        outs.extend(engine.step())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2


def test_logit_bias_steers_sampling() -> None:
    engine = LLMEngine.from_engine_args(device="cpu", dtype="float32", max_model_len=64,
                                        num_blocks=16, max_num_seqs=2, check=True, seed=0)

    def greedy(bias: dict[int, float] | None) -> list[int]:
        engine.add_request("g", {"prompt_token_ids": [1, 40, 41]}, SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias=bias))
        out = []
        for _ in bounded(engine.has_unfinished_requests):
            out = engine.step() or out
        return list(out[-1].outputs[0].token_ids)

    plain = greedy(None)
    assert greedy({77: 100.0}) == [77] * 4
    steered = greedy({plain[0]: -100.0})
    assert steered[0] != plain[0]


def test_idle_sessions_hold_at_most_half_the_slots_by_default() -> None:
    from slotserve.engine.args import EngineArgs

    def cap(**kw: Any) -> int | None:
        config = EngineArgs(**kw).create_engine_config(1024, 200)
        return config.scheduler_config.max_idle_sessions

    assert cap(max_num_seqs=16) == 8 and cap(max_num_seqs=1) == 1
    assert cap(max_num_seqs=16, max_idle_sessions=16) == 16
