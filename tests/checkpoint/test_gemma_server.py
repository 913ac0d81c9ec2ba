"""`slotserve serve --model gemma-3-270m-q4_k_m.gguf`, started as a user starts it, serves the
official `openai` client: completions, chat through the Gemma turn format (the file has no
template), streaming of both."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.checkpoint.gemma_file import gemma_path
from tests.helpers import cli_server

pytestmark = pytest.mark.gemma
NAME = "gemma-3-270m"
# What the model continues this prompt with, greedily (transformers gives the same tokens:
# test_gemma_proof.py).
PROMPT = "The capital of France is"
CONTINUATION = " the capital of the country of France. It is the largest city in France"


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    # The float32-activation kernel: CONTINUATION is the dequantized model's greedy text; with
    # int8 activations (the default) it diverges after 7 words.
    with cli_server(["--model", str(gemma_path()), "--threads", "1", "--quantization", "exact",
                     "--served-model-name", NAME, "--max-model-len", "1024",
                     "--kv-cache-memory", str(256 << 20), "--check", "--log-level",
                     "warning"]) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_and_stream(client: OpenAI) -> None:
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    text = out.choices[0].text
    assert text.startswith(CONTINUATION)
    assert out.usage is not None and out.usage.prompt_tokens == 6  # <bos> + 5 tokens
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text


def test_chat_with_the_gemma_turn_format(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."}]
    out = client.chat.completions.create(model=NAME, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=24, temperature=0)
    rendered = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                          json={"model": NAME, "messages": messages}).json()
    # <bos><start_of_turn>user\nYou are terse.\n\nName a color.<end_of_turn>\n
    # <start_of_turn>model\n  (the system message folded into the user turn)
    assert rendered["tokens"] == [2, 105, 2364, 107, 3048, 659, 17514, 236761, 108, 1567, 496,
                                  2258, 236761, 106, 107, 105, 4368, 107]
    assert out.usage is not None and out.usage.prompt_tokens == rendered["count"] == 18
    reply = out.choices[0].message.content or ""
    assert reply and out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=NAME, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply
