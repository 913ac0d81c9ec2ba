"""--api-key: every endpoint but /health needs `Authorization: Bearer KEY`."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, Served

PROTECTED = [("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/reset_prefix_cache")]
# (The keyed test server enables the admin endpoints; their key is the API key there.)


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Bearer {API_KEY}x", API_KEY,
                                    f"Basic {API_KEY}"])
def test_rejected_without_the_key(served: Served, method: str, path: str,
                                  header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    r = httpx.request(method, served.key_url + path, headers=headers, json={})
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


def test_health_needs_no_key(served: Served) -> None:
    assert httpx.get(f"{served.key_url}/health").status_code == 200


def test_accepted_with_the_key(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.key_url}/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    bad = openai.OpenAI(base_url=f"{served.key_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(f"{served.key_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and "slotserve:" in r.text
