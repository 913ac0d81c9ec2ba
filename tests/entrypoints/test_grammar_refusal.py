"""A request refused for its grammar's mask cost (structured_output.manager's mask-time
budget) reaches its client as a 400 naming the cause, code `grammar_too_expensive`: a JSON
error body for a whole reply, an SSE error event for a stream; a concurrent request from
another client is served in full, and nothing is left held (the checker is on). Through the
real server and the official `openai` client, in both engine modes. A WebSocket session so
refused ends visibly: a fatal error message naming the cause, then the socket closes with
1011 and the reason (not a session.done as if it had ended well, nor a silent drop). The
refusal names the field the client sent: `response_format`, or `tools` for a tool call's
grammar, not the engine's `structured_outputs`."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.entrypoints.conftest import MODEL_NAME, Served
from tests.entrypoints.test_sessions import ws_url
from tests.entrypoints.test_tool_calls_api import ASK, MODEL, TOOLS, hermes  # noqa: F401

GRAMMAR = {"structured_outputs": {"grammar": 'start: s\ns: s s | "a" | "b"'}}
JSON_OBJECT = {"response_format": {"type": "json_object"}}


@pytest.fixture()
def over_budget(any_mode: Served) -> Iterator[Served]:
    """Every client's grammar rows are over a budget of a nanosecond."""
    previous = any_mode.call_utility("set_mask_budget", 1e-9)
    try:
        yield any_mode
    finally:
        any_mode.call_utility("set_mask_budget", previous)


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def plain_reply(served: Served) -> openai.types.Completion:
    return client(served).completions.create(
        model=MODEL_NAME, prompt="To be", max_tokens=24, user="bystander",
        extra_body={"ignore_eos": True})


def assert_refused(body: object, param: str = "structured_outputs") -> None:
    assert isinstance(body, dict), body
    error = body.get("error", body)
    assert error["code"] == "grammar_too_expensive", error
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    assert "too costly" in error["message"] and "budget" in error["message"], error
    assert "model step" not in error["message"], error


def test_a_whole_reply_refused_for_its_masks_is_a_400(over_budget: Served) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(plain_reply, over_budget)
        with pytest.raises(openai.BadRequestError) as refused:
            client(over_budget).completions.create(
                model=MODEL_NAME, prompt="To be", max_tokens=16, n=3, user="hostile",
                extra_body={"ignore_eos": True, **GRAMMAR})
        other = bystander.result(120)
    assert refused.value.status_code == 400
    assert_refused(refused.value.body)
    (choice,) = other.choices
    assert choice.finish_reason == "length"
    assert other.usage is not None and other.usage.completion_tokens == 24


def test_a_stream_refused_for_its_masks_ends_with_an_error_event(over_budget: Served) -> None:
    stream = client(over_budget).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        stream=True, user="hostile", extra_body={"ignore_eos": True, **GRAMMAR})
    text = ""
    with pytest.raises(openai.APIError) as refused:
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    assert_refused(refused.value.body)
    assert set(text) <= {"a", "b"}  # what it sent before followed the grammar
    # The server goes on: the next plain reply is served in full.
    assert plain_reply(over_budget).choices[0].finish_reason == "length"


def test_a_session_refused_for_its_masks_closes_with_1011(over_budget: Served) -> None:
    messages: list[dict[str, Any]] = []
    with connect(ws_url(over_budget.url), open_timeout=30) as ws:
        assert json.loads(ws.recv(30))["type"] == "session.created"
        ws.send(json.dumps({"type": "input", "prompt": "To be", "max_tokens": 16,
                            "ignore_eos": True, **GRAMMAR}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(ws.recv(60)))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011, closed.value
    assert "too costly" in closed.value.rcvd.reason, closed.value.rcvd
    (error,) = [m for m in messages if m["type"] == "error"]
    assert error["fatal"] is True, error
    assert error["error"]["code"] == "grammar_too_expensive", error
    assert error["error"]["param"] == "structured_outputs", error
    assert not [m for m in messages if m["type"] in ("session.done", "chunk.done")], messages
    assert {m["type"] for m in messages} <= {"delta", "error"}, messages


def test_a_refused_response_format_names_response_format(over_budget: Served) -> None:
    with pytest.raises(openai.BadRequestError) as whole:
        client(over_budget).completions.create(
            model=MODEL_NAME, prompt="To be", max_tokens=16, user="hostile",
            extra_body={"ignore_eos": True, **JSON_OBJECT})
    assert_refused(whole.value.body, "response_format")
    stream = client(over_budget).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        stream=True, user="hostile", extra_body={"ignore_eos": True}, **JSON_OBJECT)
    with pytest.raises(openai.APIError) as streamed:
        for _ in stream:
            pass
    assert_refused(streamed.value.body, "response_format")


def test_a_refused_session_names_response_format(over_budget: Served) -> None:
    messages: list[dict[str, Any]] = []
    with connect(ws_url(over_budget.url), open_timeout=30) as ws:
        assert json.loads(ws.recv(30))["type"] == "session.created"
        ws.send(json.dumps({"type": "input", "prompt": "To be", "max_tokens": 16,
                            "ignore_eos": True, **JSON_OBJECT}))
        with pytest.raises(ConnectionClosed):
            while True:
                messages.append(json.loads(ws.recv(60)))
    (error,) = [m for m in messages if m["type"] == "error"]
    assert error["fatal"] is True, error
    assert_refused(error, "response_format")


def test_a_refused_tool_call_names_tools(hermes: Served) -> None:  # noqa: F811
    previous = hermes.call_utility("set_mask_budget", 1e-9)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            client(hermes).chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
                user="hostile")
    finally:
        hermes.call_utility("set_mask_budget", previous)
    assert_refused(refused.value.body, "tools")
