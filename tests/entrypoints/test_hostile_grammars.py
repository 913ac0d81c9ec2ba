"""Hostile and careless constraints through the real server and the official `openai` client:
grammars the library gives up on at their first token are a 400 at compile naming the field,
size caps say what was too large, a deeply nested schema is a 400; no error body carries a
panic, a backtrace, a state dump or our generated grammar. And tools with local `$defs` /
`$ref` (what `openai.pydantic_function_tool` writes) work in every tool_choice mode."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from slotserve.entrypoints.openai.errors import APIError
from slotserve.entrypoints.openai.protocol_structured import ChatCompletionToolsParam
from slotserve.entrypoints.openai.structured import tool_context
from slotserve.entrypoints.openai.tool_calls import HermesFormat
from slotserve.sampling_params import MAX_GRAMMAR_CHARS
from slotserve.structured_output.budget import grammar_check_pool
from tests.entrypoints.conftest import MODEL_NAME, Served
from tests.entrypoints.test_tool_calls_api import MODEL, client, hermes, llama3  # noqa: F401

_LEAKS = ("panicked", "backtrace", "<state>", "non-verbose", "Traceback", "%json", "start:")


def post(served: Served, body: dict[str, Any], path: str = "/v1/completions"
         ) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json={"model": MODEL_NAME, "prompt": "To be",
                                                   "max_tokens": 4, **body}, timeout=120)


def assert_clean_400(r: httpx.Response, param: str, *words: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    assert len(r.text) < 1000
    for leak in _LEAKS:
        assert leak not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize(("constraint", "param"), [
    ({"grammar": 'start: "a"~100000'}, "structured_outputs"),
    ({"grammar": 'start: "a" start'}, "structured_outputs"),
    # Refused before llguidance sees it (the validation budget), at once.
    ({"regex": "a{1000000}"}, "structured_outputs.regex"),
    ({"json": {"type": "string", "pattern": "^((a{100}){100}){100}$"}},
     "structured_outputs.json"),
])
def test_first_token_failure_is_a_400(served: Served, constraint: dict[str, Any],
                                      param: str) -> None:
    r = post(served, {"structured_outputs": constraint})
    assert_clean_400(r, param, "grammar")
    # The engine goes on, and the next plain request is served.
    assert post(served, {}).status_code == 200


def test_size_caps_say_what_was_too_large(served: Served) -> None:
    big = "a" * (MAX_GRAMMAR_CHARS + 1)
    r = post(served, {"structured_outputs": {"regex": big}})
    assert_clean_400(r, "structured_outputs.regex", "more than the limit", str(len(big)))
    r = post(served, {"structured_outputs": {"json": json.dumps(
        {"type": "string", "description": big})}})
    assert_clean_400(r, "structured_outputs.json", "more than the limit")


def test_deeply_nested_schema_text_is_a_400(served: Served) -> None:
    deep = '{"type": "array", "items": ' * 1000 + '{"type": "integer"}' + "}" * 1000
    r = post(served, {"structured_outputs": {"json": deep}})
    assert_clean_400(r, "structured_outputs.json", "nests too deeply")


def test_tools_grammar_over_the_cap_names_tools() -> None:
    # (Through a server the rendered prompt, which holds the tools, is refused first at this
    # size; a long-context model would reach the grammar's cap.)
    enum = [f"value-{i:07d}" for i in range(80_000)]
    tool = ChatCompletionToolsParam.model_validate({"type": "function", "function": {
        "name": "pick", "parameters": {"type": "object", "properties": {"v": {"enum": enum}}}}})
    with pytest.raises(APIError) as info:
        tool_context([tool], "required", True, HermesFormat())
    assert info.value.param == "tools"
    assert "more than the limit" in str(info.value.message)
    assert "must be a non-empty string" not in str(info.value.message)


# ----------------------------------------------------------------------------- $ref tools

class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    floor: int = pydantic.Field(ge=0, le=9)


class Visit(pydantic.BaseModel):
    home: Address
    stops: list[Address] = pydantic.Field(max_length=2)


VISIT = openai.pydantic_function_tool(Visit)
VISIT_SCHEMA = VISIT["function"]["parameters"]
assert "$defs" in VISIT_SCHEMA  # what the test is about
PLAIN = {"type": "function", "function": {"name": "noop"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(params=["hermes", "llama3"])
def tool_server(request: pytest.FixtureRequest) -> Served:
    served: Served = request.getfixturevalue(request.param)
    return served


@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_pydantic_tool_with_refs(tool_server: Served, choice: str) -> None:
    tool_choice: Any = ({"type": "function", "function": {"name": "Visit"}}
                        if choice == "named" else choice)
    out = client(tool_server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[VISIT, PLAIN],  # type: ignore[list-item]
        tool_choice=tool_choice, max_tokens=300, temperature=1.0, seed=3)
    message = out.choices[0].message
    if choice == "none":
        assert not message.tool_calls
        return
    if choice == "auto" and not message.tool_calls:
        pytest.fail(f"the scripted model writes a call in auto mode: {message.content!r}")
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function"
        assert call.function.name in ({"Visit"} if choice == "named" else {"Visit", "noop"})
        if call.function.name == "Visit":
            jsonschema.validate(json.loads(call.function.arguments), VISIT_SCHEMA)


def test_self_referencing_tool_schema(tool_server: Served) -> None:
    tree = {"type": "object", "additionalProperties": False, "required": ["v"],
            "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                           "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}}}
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    out = client(tool_server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required",  # type: ignore[list-item]
        max_tokens=300, seed=1)
    # The grammar bounds the tree's width, not its depth: a random model may run out of
    # tokens inside it (then no call is returned); any call returned is valid.
    calls = out.choices[0].message.tool_calls or []
    assert calls or out.choices[0].finish_reason == "length"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tree)


# ----------------------------------------------------------------------------- validation time

# The chaos benchmark's 0.9 MB schema: llguidance took 6 s (109 s on a loaded machine) to
# validate it, on the threads that tokenize every request.
HUGE_SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 40 + 1}}}$"} for i in range(12_000)}}


def test_schema_over_the_budget_is_a_400_at_once(served: Served) -> None:
    r = post(served, {"structured_outputs": {"json": HUGE_SCHEMA}})
    assert_clean_400(r, "structured_outputs.json", "12000 properties", "limit")
    r = post(served, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": HUGE_SCHEMA}}})
    assert_clean_400(r, "response_format", "properties")
    tool = {"type": "function", "function": {"name": "f", "parameters": HUGE_SCHEMA}}
    r = post(served, {"messages": ASK, "tools": [tool], "tool_choice": "required"},
             "/v1/chat/completions")
    assert_clean_400(r, "tools", "properties")


def test_constraints_are_checked_apart_from_tokenization(served: Served) -> None:
    # Hold this client's turn on the grammar-check threads: its constrained requests wait
    # for it, but they occupy no thread that tokenizes, so plain requests (more than the
    # front has threads) go on.
    release = threading.Event()
    grammar_check_pool().submit(release.wait, 60, client="addr:127.0.0.1")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        try:
            held = [pool.submit(post, served, {"structured_outputs": {"regex": f"(a|b){{{i}}}"}})
                    for i in range(1, 4)]
            time.sleep(0.5)
            plain = [pool.submit(post, served, {}) for _ in range(4)]
            assert [f.result(timeout=60).status_code for f in plain] == [200] * 4
            assert not any(f.done() for f in held)
        finally:
            release.set()
        assert [f.result(timeout=60).status_code for f in held] == [200] * 3


def test_session_constraints_are_checked_apart_from_tokenization(served: Served) -> None:
    # As for HTTP: a session chunk's constraint waits for its client's turn on the
    # grammar-check threads (held here), occupying no thread that tokenizes.
    from websockets.sync.client import connect

    from tests.entrypoints.test_sessions import recv, ws_url

    release = threading.Event()
    grammar_check_pool().submit(release.wait, 60, client="user:held")
    with connect(ws_url(served.url), open_timeout=30) as ws, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            assert recv(ws)["type"] == "session.created"
            ws.send(json.dumps({"type": "input", "prompt": "Speak:", "max_tokens": 3,
                                "user": "held", "structured_outputs": {"regex": "[a-z]+"}}))
            plain = [pool.submit(post, served, {}) for _ in range(4)]
            assert [f.result(timeout=60).status_code for f in plain] == [200] * 4
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.5)  # the chunk still waits for the grammar check
        finally:
            release.set()
        while (msg := recv(ws))["type"] == "delta":
            pass
        assert msg["type"] == "chunk.done", msg
        ws.send(json.dumps({"type": "end"}))
        assert recv(ws)["type"] == "session.done"
