"""Prompt -> validated core Requests: tokenization, context limits, n > 1 fan-out."""

from __future__ import annotations

from typing import Any

import pytest

from slotserve.engine.processor import Processor, apply_chat_template
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import SamplingParams
from tests.helpers import TOKENIZER_BOS as BOS, TOKENIZER_EOS as EOS


@pytest.fixture
def processor(tokenizer: Any) -> Processor:
    return Processor(tokenizer, max_model_len=64, vocab_size=len(tokenizer), eos_token_ids=[EOS])


def test_text_and_token_id_prompts(processor: Processor, tokenizer: Any) -> None:
    p = processor.process("a", "To be", SamplingParams(max_tokens=5))
    assert p.prompt == "To be"
    assert p.prompt_token_ids == tokenizer.encode("To be")
    assert p.prompt_token_ids[0] == BOS
    (req,) = p.requests
    assert req.request_id == "a" and req.eos_token_id == EOS and req.sampling_params.max_tokens == 5
    p = processor.process("b", {"prompt_token_ids": [5, 6, 7]}, None)
    assert p.prompt is None and p.requests[0].prompt_token_ids == [5, 6, 7]


def test_max_tokens_none_means_up_to_the_context(processor: Processor) -> None:
    p = processor.process("a", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=None))
    assert p.requests[0].sampling_params.max_tokens == 54
    p = processor.process("a", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=500))
    assert p.requests[0].sampling_params.max_tokens == 54


@pytest.mark.parametrize("prompt, param", [
    ({"prompt_token_ids": [5] * 64}, "prompt"),
    ({"prompt_token_ids": [5] * 100}, "prompt"),
    ({"prompt_token_ids": []}, "prompt"),
    ({"prompt_token_ids": [5, 10_000]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, "x"]}, "prompt_token_ids"),
    ({"text": "x"}, "prompt"),
    (3.5, "prompt"),
])
def test_bad_prompts(processor: Processor, prompt: Any, param: str) -> None:
    with pytest.raises(RequestValidationError) as info:
        processor.process("a", prompt, SamplingParams())
    assert info.value.param == param


def test_prompt_at_the_limit_is_accepted(processor: Processor) -> None:
    p = processor.process("a", {"prompt_token_ids": [5] * 63}, SamplingParams(max_tokens=None))
    assert p.requests[0].sampling_params.max_tokens == 1


def test_min_tokens_beyond_context(processor: Processor) -> None:
    with pytest.raises(RequestValidationError) as info:
        processor.process("a", {"prompt_token_ids": [5] * 60},
                          SamplingParams(min_tokens=10, max_tokens=None))
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"), ({"logprobs": 99}, "logprobs"),
])
def test_invalid_sampling_values(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_n_fans_out_with_seeds(processor: Processor) -> None:
    p = processor.process("r", "To be", SamplingParams(n=3, seed=7, temperature=1.0))
    assert [r.request_id for r in p.requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in p.requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in p.requests)
    assert all(r.prompt_token_ids == p.prompt_token_ids for r in p.requests)
    p = processor.process("r", "To be", SamplingParams(n=2))
    assert [r.sampling_params.seed for r in p.requests] == [None, None]


def test_extra_eos_ids_become_stop_tokens(tokenizer: Any) -> None:
    proc = Processor(tokenizer, 64, len(tokenizer), eos_token_ids=[EOS, 2])
    (req,) = proc.process("a", "x", SamplingParams(stop_token_ids=[9])).requests
    assert req.eos_token_id == EOS and req.sampling_params.stop_token_ids == [9, 2]
    (req,) = proc.process("a", "x", SamplingParams(ignore_eos=True)).requests
    assert req.eos_token_id is None and not req.sampling_params.stop_token_ids


def test_sessions_reject_n_and_stop_strings(processor: Processor) -> None:
    with pytest.raises(RequestValidationError):
        processor.process("s", "x", SamplingParams(n=2), resumable=True)
    with pytest.raises(RequestValidationError):
        processor.process("s", "x", SamplingParams(stop="y"), resumable=True)
    # A continuation may be empty but counts the session's tokens against the context.
    processor.process("s", {"prompt_token_ids": []}, None, resumable=True, continuation_of=10)
    with pytest.raises(RequestValidationError):
        processor.process("s", {"prompt_token_ids": [5] * 10}, None, resumable=True,
                          continuation_of=60)


def test_chat_template(tokenizer: Any) -> None:
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt["prompt"] == "<s>user: hi\nassistant:"
    assert prompt["prompt_token_ids"].count(BOS) == 1  # the template's BOS, not doubled
    with pytest.raises(RequestValidationError):
        apply_chat_template(tokenizer, "hi")  # type: ignore[arg-type]
