"""Structured outputs through the server with the official `openai` client: OpenAI's
response_format (json_schema, json_object) and vLLM's structured_outputs (json, regex, choice,
grammar), chat and completions, streaming and not, n > 1, 32 concurrent requests mixing
constrained and free ones, and every bad constraint a 400 that disturbs nothing."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, Served
from tests.structured_output.schemas import random_schemas

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["speaker", "line"],
          "properties": {"speaker": {"enum": ["HAMLET", "OPHELIA", "GHOST"]},
                         "line": {"type": "string", "maxLength": 24},
                         "act": {"type": "integer", "minimum": 1, "maximum": 5}}}
MESSAGES = [{"role": "user", "content": "Give me a line of the play as JSON."}]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "line", "schema": schema,
                                                   "strict": True}}


def test_response_format_json_schema_chat(any_mode: Served) -> None:
    c = client(any_mode)
    full = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                     n=3, temperature=1.0, seed=5,
                                     response_format=response_format(SCHEMA))
    assert len(full.choices) == 3
    assert any(ch.finish_reason == "stop" for ch in full.choices)
    for ch in full.choices:
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    greedy = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                       temperature=0, response_format=response_format(SCHEMA))
    stream = list(c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                            temperature=0, stream=True,
                                            response_format=response_format(SCHEMA)))
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == greedy.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_extra_field_and_completions(drained: Served) -> None:
    c = client(drained)
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": r"(Act|Scene) [IV]{1,3}: [a-z]{2,10}\."},
         lambda t: re.fullmatch(r"(Act|Scene) [IV]{1,3}: [a-z]{2,10}\.", t)),
        ({"choice": ["tragedy", "comedy", "history"]},
         lambda t: t in ("tragedy", "comedy", "history")),
        ({"grammar": 'start: NAME " loves " NAME\nNAME: /[A-Z][a-z]{1,8}/'},
         lambda t: re.fullmatch(r"[A-Z][a-z]{1,8} loves [A-Z][a-z]{1,8}", t)),
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    for spec, ok in cases:
        out = c.completions.create(model=MODEL_NAME, prompt="To be, or not", max_tokens=40,
                                   n=2, temperature=0.8, seed=3,
                                   extra_body={"structured_outputs": spec})
        chat = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40,
                                         temperature=0.8, seed=3,
                                         extra_body={"structured_outputs": spec})
        texts = [(ch.text, ch.finish_reason) for ch in out.choices]
        texts.append((chat.choices[0].message.content, chat.choices[0].finish_reason))
        assert any(f == "stop" for _, f in texts), (spec, texts)
        for text, finish in texts:
            if finish == "stop":
                assert ok(text), (spec, text)
    # Legacy completions have no response_format in the client: vLLM takes it in extra_body.
    streamed = list(c.completions.create(model=MODEL_NAME, prompt="Speak", max_tokens=40,
                                         temperature=0, stream=True, extra_body={
                                             "response_format": response_format(SCHEMA)}))
    jsonschema.validate(json.loads("".join(ch.choices[0].text for ch in streamed)), SCHEMA)
    obj = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30,
                                    temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_32_concurrent_requests_mixing_constrained_and_free(drained: Served) -> None:
    schemas = random_schemas(16, seed=11)

    async def run() -> list[tuple[dict[str, Any] | None, str, str | None]]:
        c = openai.AsyncOpenAI(base_url=f"{drained.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)

        async def one(i: int) -> tuple[dict[str, Any] | None, str, str | None]:
            schema = schemas[i // 2] if i % 2 == 0 else None
            fmt = response_format(schema) if schema is not None else openai.NOT_GIVEN
            kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=80, temperature=1.0,
                                      seed=i, response_format=fmt,
                                      messages=[{"role": "user", "content": f"Line {i}"}])
            if i % 4 < 2:
                r = await c.chat.completions.create(**kw)
                return schema, r.choices[0].message.content or "", r.choices[0].finish_reason
            text, finish = "", None
            async for ch in await c.chat.completions.create(stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
            return schema, text, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await c.close()

    results = asyncio.run(run())
    constrained = [(s, t, f) for s, t, f in results if s is not None]
    assert sum(f == "stop" for _, _, f in constrained) >= 12
    for schema, text, finish in constrained:
        assert finish in ("stop", "length")
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert all(t for s, t, _ in results if s is None)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("invalid-schema-type", {"response_format": response_format({"type": "objekt"})},
     "response_format"),
    ("schema-bad-ref", {"response_format": response_format(
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})},
     "response_format"),
    ("json-schema-without-schema", {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ("unknown-response-format", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("regex-lookahead", {"structured_outputs": {"regex": "(?=a)abc"}},
     "structured_outputs.regex"),
    ("regex-backreference", {"structured_outputs": {"regex": r"(a)\1"}},
     "structured_outputs.regex"),
    ("lark-undefined-rule", {"structured_outputs": {"grammar": "start: nothing_here"}},
     "structured_outputs.grammar"),
    ("two-constraints", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("empty-choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("both-fields", {"response_format": {"type": "json_object"},
                     "structured_outputs": {"regex": "a"}}, "response_format"),
    ("min-tokens", {"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ("tool-choice-unknown-name", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("tools-malformed-parameters", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strung"}}}}}],
        "tool_choice": "none"}, "tools"),
    ("tools-parameters-not-object", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}]}, "tools"),
    ("tool-name-invalid", {
        "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ("tool-choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("tools-without-format", {  # the bundled template shows no tool-call format
        "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize(("case", "fields", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_are_400(drained: Served, case: str, fields: dict[str, Any],
                                 param: str) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **fields}
    r = httpx.post(f"{drained.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError) as info:
        client(drained).chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                max_tokens=5, extra_body=fields)
    assert info.value.param == param
    # Nothing disturbed: a normal request runs, and the engine holds nothing after.
    ok = client(drained).chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                 max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_grammar_the_tokenizer_cannot_compile_is_400_in_both_modes(any_mode: Served) -> None:
    # Valid Lark naming a special token the bundled tokenizer lacks: only the core's compile
    # against the tokenizer finds it, after the request was accepted; still a 400.
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5,
            "structured_outputs": {"grammar": 'start: "a" <|not_a_token|>'}}
    for stream in (False, True):
        r = httpx.post(f"{any_mode.url}/v1/chat/completions", json={**body, "stream": stream},
                       timeout=30)
        assert r.status_code == 400, r.text
        assert "not_a_token" in r.json()["error"]["message"]


def test_a_session_is_held_to_its_grammar_across_chunks(drained: Served) -> None:
    from transformers import AutoTokenizer
    from websockets.sync.client import connect

    from slotserve.engine.args import DEFAULT_MODEL
    from tests.entrypoints.test_sessions import recv, ws_url

    chunks: list[list[int]] = []
    with connect(ws_url(drained.url), open_timeout=30) as ws:
        recv(ws)
        for i, chunk in enumerate([{"structured_outputs": {"regex": "([a-z]{3} ){1,30}"}},
                                   {}, {"structured_outputs": {"regex": "([a-z]{3} ){1,30}"}}]):
            ws.send(json.dumps({"type": "input", "prompt": " and" if i else "Speak:",
                                "max_tokens": 5, "temperature": 0, **chunk}))
            tokens: list[int] = []
            while (msg := recv(ws))["type"] == "delta":
                tokens += msg["token_ids"]
            assert msg["type"] == "chunk.done", msg
            assert len(tokens) == 5
            chunks.append(tokens)
        # Changing a session's grammar is refused.
        ws.send(json.dumps({"type": "input", "prompt": " x", "max_tokens": 2,
                            "structured_outputs": {"regex": "[0-9]+"}}))
        assert recv(ws)["type"] == "error"
    # The chunks are one output stream under the one grammar: each fold drops the last token
    # its chunk sampled (the next chunk's first token re-samples it), so what the session
    # kept, plus the last chunk's last token, is a prefix of a document of the grammar; the
    # chunk without structured_outputs (the middle one) is held to it too.
    kept = [t for c in chunks[:-1] for t in c[:-1]] + chunks[-1]
    text = AutoTokenizer.from_pretrained(DEFAULT_MODEL).decode(kept)
    assert re.fullmatch(r"([a-z]{3} )*[a-z]{0,3}", text), (text, chunks)


def test_a_session_refuses_a_bad_constraint_chunk_and_goes_on(drained: Served) -> None:
    """Changing the session's constraint (through structured_outputs or response_format), or
    adding min_tokens to a constrained session, refuses that chunk only: a non-fatal error,
    and the next chunk runs under the first chunk's response_format."""
    from websockets.sync.client import connect

    from tests.entrypoints.test_sessions import recv, ws_url

    def chunk(**fields: Any) -> str:
        return json.dumps({"type": "input", "prompt": " and", "max_tokens": 4,
                           "temperature": 0, **fields})

    def run(ws: Any, message: str) -> tuple[str, dict[str, Any]]:
        ws.send(message)
        text = ""
        while (msg := recv(ws))["type"] == "delta":
            text += msg["text"]
        return text, msg

    with connect(ws_url(drained.url), open_timeout=30) as ws:
        recv(ws)
        text, done = run(ws, chunk(prompt="Speak:", response_format={"type": "json_object"}))
        assert done["type"] == "chunk.done" and text.lstrip().startswith("{"), (text, done)
        for bad, param in ((chunk(structured_outputs={"regex": "[0-9]+"}), "structured_outputs"),
                           (chunk(response_format=response_format(SCHEMA)), "response_format"),
                           (chunk(min_tokens=2), "min_tokens")):
            ws.send(bad)
            refused = recv(ws)
            assert refused["type"] == "error" and refused["fatal"] is False, refused
            assert refused["error"]["param"] == param, refused
        # The same constraint again is no change; the session goes on, still constrained.
        _, done = run(ws, chunk(response_format={"type": "json_object"}))
        assert done["type"] == "chunk.done" and done["chunk"] == 1, done
        _, done = run(ws, chunk())
        assert done["type"] == "chunk.done" and done["chunk"] == 2, done
        ws.send(json.dumps({"type": "end"}))
        assert recv(ws)["type"] == "session.done"
