"""Offline `LLM.chat` renders a chat template within the server's bounds (a child process
bounded in time, memory and output size: slotserve.checkpoint.chat_render), so a hostile
template cannot hang or exhaust the caller's process; a plain one renders as before."""

from __future__ import annotations

import time

import pytest

from slotserve.checkpoint.chat_render import ChatTemplateError
from slotserve.engine.processor import apply_chat_template
from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams
from tests.helpers import FakeEngineFactory

ASK = [{"role": "user", "content": "Hello"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'a' * 3000000000 }}"


@pytest.fixture
def llm(fake_engine: FakeEngineFactory) -> LLM:
    llm = LLM(llm_engine=fake_engine())
    llm.llm_engine.processor.chat_renderer.timeout_s = 2.0
    return llm


def test_a_template_that_runs_forever_is_stopped(llm: LLM) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than") as info:
        llm.chat(ASK, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=LOOPS)
    assert info.value.param == "messages"
    # Unbounded, the render would run for hours (the child's first render also loads the
    # tokenizer, which is not part of the bound).
    assert time.monotonic() - start < 90


def test_a_template_that_allocates_gigabytes_is_refused(llm: LLM) -> None:
    with pytest.raises(ChatTemplateError, match="memory|characters|longer than"):
        llm.chat(ASK, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=HUGE)


def test_a_plain_template_renders_as_before(llm: LLM) -> None:
    out = llm.chat(ASK, SamplingParams(max_tokens=2), use_tqdm=False)
    expected = apply_chat_template(llm.llm_engine.tokenizer, ASK)
    assert out[0].prompt_token_ids == expected["prompt_token_ids"]
    # And the engine goes on after a refused render.
    with pytest.raises(ChatTemplateError):
        llm.chat(ASK, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=LOOPS)
    assert llm.chat(ASK, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
