"""Large request bodies are decoded apart from the threads that tokenize, with json.loads and
strict validation of the Python objects (openai.body): every body gets the verdict and the
error that pydantic's strict JSON validation gives it, and through the real server a large
body is served, a large malformed one a 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from slotserve.entrypoints.openai.api_server import OFF_LOOP_BODY_BYTES
from slotserve.entrypoints.openai.body import decode_body
from slotserve.entrypoints.openai.errors import APIError, from_pydantic_errors
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.entrypoints.conftest import MODEL_NAME, Served

SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
BODIES: list[dict[str, Any]] = [
    {"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 0.5,
     "stop": ["a", "b"], "logit_bias": {"12": -1.5}, "structured_outputs": {"json": SCHEMA}},
    {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "seed": 3, "user": "u"},
    {"model": "m", "prompt": "Hi", "max_tokens": "5"},
    {"model": "m", "prompt": "Hi", "n": True},
    {"model": "m", "prompt": "Hi", "temperature": "hot"},
    {"model": "m", "prompt": {"not": "a prompt"}},
    {"model": "m", "prompt": "Hi", "structured_outputs": {"json": 5}},
    {"model": "m", "prompt": "Hi", "response_format": {"type": "xml"}},
    {"prompt": "Hi"},
]


def verdict(fn: Any, body: bytes) -> Any:
    try:
        return fn(body).model_dump()
    except ValidationError as exc:
        return [(e["type"], e["loc"]) for e in exc.errors()]


@pytest.mark.parametrize("body", BODIES)
def test_the_same_verdict_as_strict_json_validation(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    for model in (CompletionRequest, ChatCompletionRequest):
        assert (verdict(lambda b, m=model: decode_body(m, b), raw)
                == verdict(model.model_validate_json, raw))


@pytest.mark.parametrize(("raw", "code"), [
    (b'{"model": "m", "prompt": "Hi", "temperature": NaN}', "invalid_json"),
    (b'{"model": "m", "prompt": "Hi"', "invalid_json"),
    (b'{"model": "m", "prompt": "\xff"}', "invalid_json"),
    (b'{"model": "m", "prompt": "Hi", "temperature": -Infinity}', "invalid_json"),
    (b'[' * 100_000 + b']' * 100_000, "too_deep"),
    (b'{"model": "m", "prompt": "Hi", "user": ' + b'[' * 250 + b']' * 250 + b'}', "too_deep"),
])
def test_not_json_is_a_400(raw: bytes, code: str) -> None:
    with pytest.raises(APIError) as info:
        decode_body(CompletionRequest, raw)
    assert info.value.status == 400 and info.value.code == code


def nested_schema(depth: int) -> bytes:
    """A completion body whose schema nests `depth` objects (two JSON levels each)."""
    inner = b'{"type": "string"}'
    for _ in range(depth):
        inner = b'{"type": "object", "properties": {"a": ' + inner + b'}}'
    return b'{"model": "m", "prompt": "Hi", "structured_outputs": {"json": ' + inner + b'}}'


def test_a_body_past_200_levels_is_too_deep_on_both_paths() -> None:
    """The small-body path (model_validate_json) and the large one (from_json) both stop
    at about 200 levels, and both answer too_deep, not invalid_json."""
    decode_body(CompletionRequest, nested_schema(90))  # 183 levels: served
    raw = nested_schema(110)  # 223 levels
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(raw)
    assert from_pydantic_errors(info.value.errors()).code == "too_deep"
    with pytest.raises(APIError) as api:
        decode_body(CompletionRequest, raw)
    assert api.value.status == 400 and api.value.code == "too_deep"


def test_too_deep_through_the_server(served: Served) -> None:
    raw = nested_schema(110)
    for body in (raw, raw[:-1] + b', "user": "' + b"x" * OFF_LOOP_BODY_BYTES + b'"}'):
        r = httpx.post(f"{served.url}/v1/completions", timeout=60, content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_deep", r.text


def test_large_bodies_through_the_server(served: Served) -> None:
    pad = "x" * OFF_LOOP_BODY_BYTES
    r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "user": pad})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "Hi", "max_tokens": "2", "user": pad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(f"{served.url}/v1/completions", timeout=60,
                   content=b'{"model": "m", "user": "' + pad.encode() + b'"',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
