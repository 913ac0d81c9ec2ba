"""Every malformed request: the right 4xx, an OpenAI-style error body, no engine contact, and
the server still answers a normal request afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.limits import MIB, ServerLimits, default_max_body_bytes
from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL_NAME, Served

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "Hi"}]


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": OK_MSG, "max_tokens": 4, **fields}


# (id, path, body (dict, or raw bytes), status, expected error param or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("invalid-json", CMPL, b'{"prompt": "Hello", ', 400, None),
    ("not-an-object", CMPL, b"[1, 2, 3]", 400, None),
    ("empty-body", CMPL, b"", 400, None),
    ("missing-prompt", CMPL, {"model": MODEL_NAME}, 400, "prompt"),
    ("max-tokens-string", CMPL, cmpl(max_tokens="5"), 400, "max_tokens"),
    ("temperature-string", CMPL, cmpl(temperature="hot"), 400, "temperature"),
    ("n-bool", CMPL, cmpl(n=True), 400, "n"),
    ("stop-number", CMPL, cmpl(stop=5), 400, "stop"),
    ("messages-not-list", CHAT, chat(messages="hello"), 400, "messages"),
    ("unknown-model", CMPL, cmpl(model="gpt-9"), 404, "model"),
    ("unknown-model-chat", CHAT, chat(model="gpt-9"), 404, "model"),
    ("empty-prompt", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("empty-prompt-list", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("empty-prompt-in-batch", CMPL, cmpl(prompt=["a", ""]), 400, "prompt"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("prompt-too-long", CMPL, cmpl(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("prompt-fills-context", CMPL, cmpl(prompt=[5] * MAX_MODEL_LEN), 400, "prompt"),
    ("token-out-of-vocab", CMPL, cmpl(prompt=[1, 10**7]), 400, "prompt_token_ids"),
    ("max-tokens-zero", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max-tokens-beyond-context", CMPL, cmpl(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("max-completion-tokens-beyond", CHAT, chat(max_completion_tokens=10**6), 400,
     "max_completion_tokens"),
    ("temperature-negative", CMPL, cmpl(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", CMPL, cmpl(top_p=0.0), 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top-k-negative", CMPL, cmpl(top_k=-5), 400, "top_k"),
    ("min-p-above-one", CMPL, cmpl(min_p=1.5), 400, "min_p"),
    ("n-zero", CMPL, cmpl(n=0), 400, "n"),
    ("n-too-large", CHAT, chat(n=100000), 400, "n"),
    ("logprobs-too-large", CMPL, cmpl(logprobs=100), 400, "logprobs"),
    ("logprobs-negative", CMPL, cmpl(logprobs=-1), 400, "logprobs"),
    ("top-logprobs-too-large", CHAT, chat(logprobs=True, top_logprobs=50), 400,
     "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("too-many-stop-strings", CMPL, cmpl(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("empty-stop-string", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages.0.role"),
    ("image-content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content"),
    ("presence-penalty-range", CMPL, cmpl(presence_penalty=5.0), 400, "presence_penalty"),
    ("frequency-penalty-range", CHAT, chat(frequency_penalty=-3.0), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CMPL, cmpl(repetition_penalty=0.0), 400, "repetition_penalty"),
    ("min-tokens-above-max", CMPL, cmpl(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    ("stop-token-ids-negative", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("best-of", CMPL, cmpl(best_of=3), 400, "best_of"),
    ("oversize-body", CMPL, cmpl(prompt="x" * (9 * 1024 * 1024)), 413, None),
    ("tokenize-neither", "/tokenize", {"model": MODEL_NAME}, 400, "prompt"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [1, -4]}, 400, "tokens"),
    # Issue 11: numbers the worker could not hold, unbounded lists, client priority.
    ("top-k-overflows-int64", CMPL, cmpl(top_k=2**63), 400, "top_k"),
    ("seed-overflows-int64", CHAT, chat(seed=2**64), 400, "seed"),
    ("temperature-absurd", CMPL, cmpl(temperature=1e300), 400, "temperature"),
    ("repetition-penalty-tiny", CMPL, cmpl(repetition_penalty=1e-300), 400,
     "repetition_penalty"),
    ("stop-token-ids-100k", CMPL, cmpl(stop_token_ids=list(range(100_000))), 400,
     "stop_token_ids"),
    ("stop-token-ids-800k-over-the-body-cap", CMPL, cmpl(stop_token_ids=list(range(800_000))),
     413, None),
    ("stop-token-id-out-of-vocab", CMPL, cmpl(stop_token_ids=[10**7]), 400, "stop_token_ids"),
    ("stop-string-too-long", CMPL, cmpl(stop=["x" * 10_000]), 400, "stop"),
    ("logit-bias-too-many", CMPL, cmpl(logit_bias={str(i): 1 for i in range(5000)}), 400,
     "logit_bias"),
    ("logit-bias-value", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit-bias-key", CMPL, cmpl(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", CMPL, cmpl(logit_bias={str(10**7): 1}), 400, "logit_bias"),
    ("prompts-times-n", CMPL, cmpl(prompt=["a"] * 100, n=4), 400, "n"),
    ("too-many-prompts", CMPL, cmpl(prompt=["a"] * 300), 400, "prompt"),
    ("priority-under-fcfs", CMPL, cmpl(priority=-10), 400, "priority"),
    # Under the body cap (about 1.2 MiB for this engine), over what 512 tokens can spell.
    ("prompt-text-too-long-for-context", CMPL, cmpl(prompt="To be " * 150_000), 400, "prompt"),
    ("chat-too-long-for-context", CHAT, chat(messages=[{"role": "user",
                                                        "content": "ab " * 300_000}]), 400,
     "messages"),
    # Over it: refused from the Content-Length, unread.
    ("prompt-text-over-the-body-cap", CMPL, cmpl(prompt="To be " * 250_000), 413, None),
]


@pytest.fixture()
def counted(drained: Served) -> Iterator[tuple[Served, Callable[[], list[str]]]]:
    """Counts every request that reaches the engine core (`seen()`: their ids so far)."""
    drained.call_utility("count_added_requests")
    try:
        yield drained, lambda: drained.call_utility("counted_requests")
    finally:
        drained.call_utility("stop_counting_requests")


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(counted: tuple[Served, Callable[[], list[str]]], path: str, body: Any,
                     status: int, param: str | None) -> None:
    served, seen = counted
    with httpx.Client(base_url=served.url, timeout=30) as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert status in (400, 404, 413) and error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
        assert seen() == [], "a malformed request reached the engine"
        ok = http.post(CMPL, json=cmpl(max_tokens=2, ignore_eos=True))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 2
        assert len(seen()) == 1


def test_unknown_route_and_method(drained: Served) -> None:
    r = httpx.get(f"{drained.url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{drained.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_the_body_cap_follows_what_a_client_may_have_waiting(served: Served) -> None:
    # 1 MiB + 8 bytes per token of one client's share of the waiting tokens, at most 8 MiB:
    # this engine (512-token context, 24 slots) admits 24,576 tokens a client.
    limits = ServerLimits()
    assert limits.max_body_bytes is None and limits.body_limit == 8 * MIB
    assert default_max_body_bytes(24_576) == MIB + 8 * 24_576
    assert default_max_body_bytes(10**7) == 8 * MIB
    app = build_app(served.engine, served_model_names=[MODEL_NAME], shutdown_engine=False)
    assert app.state.limits.max_body_bytes == default_max_body_bytes(
        app.state.admission.client_max_tokens) == MIB + 8 * 24_576
    given = build_app(served.engine, served_model_names=[MODEL_NAME], shutdown_engine=False,
                      limits=ServerLimits(max_body_bytes=4096))
    assert given.state.limits.max_body_bytes == 4096
    with httpx.Client(base_url=served.url, timeout=30) as http:
        r = http.post(CMPL, json=cmpl(prompt="To be " * 250_000))
    assert r.status_code == 413
    assert f"exceeds the limit of {MIB + 8 * 24_576}" in r.json()["error"]["message"]
