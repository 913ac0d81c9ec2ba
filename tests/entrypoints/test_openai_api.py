"""The OpenAI endpoints through the official `openai` client and through httpx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, Served, scrape

PROMPT = "To be, or not to be, that is the question:"


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def greedy_tokens(served: Served, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def test_completion_non_streaming(drained: Served) -> None:
    out = client(drained).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    n_prompt = len(httpx.post(f"{drained.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == n_prompt + 12


def test_completion_streaming_matches_non_streaming(any_mode: Served) -> None:
    c = client(any_mode)
    full = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_non_streaming_and_streaming(any_mode: Served) -> None:
    c = client(any_mode)
    messages = [{"role": "system", "content": "You are a poet."},
                {"role": "user", "content": "Speak of the sea."}]
    full = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.completion_tokens == 10
    n_prompt = httpx.post(f"{any_mode.url}/tokenize", json={"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    stream = list(c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == msg.content
    assert stream[-1].usage.completion_tokens == 10
    assert stream[-1].usage.total_tokens == n_prompt + 10


def test_n_greater_than_one(any_mode: Served) -> None:
    c = client(any_mode)
    out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3,
                               temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert all(ch.finish_reason == "length" for ch in out.choices)
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3,
                                       temperature=1.0, seed=7, stream=True,
                                       extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(3)}
    finishes = {i: 0 for i in range(3)}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    # Same seed, same sequences: streaming and not agree choice by choice.
    assert texts == {ch.index: ch.text for ch in out.choices}
    assert finishes == {0: 1, 1: 1, 2: 1}
    chat = c.chat.completions.create(model=MODEL_NAME, n=2, max_tokens=4,
                                     messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"ignore_eos": True})
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_batched_prompts(drained: Served) -> None:
    c = client(drained)
    out = c.completions.create(model=MODEL_NAME, prompt=["To be", "or not"], max_tokens=3,
                               n=2, temperature=0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    single = c.completions.create(model=MODEL_NAME, prompt="or not", max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[2].text == single.choices[0].text
    ids = c.completions.create(model=MODEL_NAME, prompt=[[1, 300, 301], [1, 302]],
                               max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_stop_strings(any_mode: Served) -> None:
    text, tokens = greedy_tokens(any_mode, PROMPT, 24)
    # A stop string taken from the middle of the greedy output must cut the text there.
    stop = tokens[5] + tokens[6]
    cut = text.find(stop)
    assert cut >= 0
    out = client(any_mode).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                             temperature=0, stop=[stop, "zzzzqqq"],
                                             extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == text[:cut] and choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop
    chunks = list(client(any_mode).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(any_mode: Served) -> None:
    c = client(any_mode)
    out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                               logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok_lp <= 0.0 and len(top) <= 3
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(tok_lp, abs=1e-4)
        assert tok in top
    chat = c.chat.completions.create(model=MODEL_NAME, max_tokens=5, temperature=0,
                                     logprobs=True, top_logprobs=2,
                                     messages=[{"role": "user", "content": "Hello"}],
                                     extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    chunks = list(c.chat.completions.create(model=MODEL_NAME, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            messages=[{"role": "user", "content": "Hello"}],
                                            extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_extra_sampling_fields_take_effect(drained: Served) -> None:
    c = client(drained)

    def run(max_tokens: int = 16, **fields: Any) -> Any:
        known = {k: fields.pop(k) for k in ("temperature", "seed", "presence_penalty",
                                            "frequency_penalty") if k in fields}
        out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens,
                                   **known, extra_body={"ignore_eos": True, **fields})
        return out.choices[0], out.usage.completion_tokens

    greedy, _ = run(temperature=0)
    # top_k 1 and min_p 1 leave only the likeliest token: greedy at any temperature.
    for field in ({"top_k": 1}, {"min_p": 1.0}):
        assert run(temperature=1.5, seed=3, **field)[0].text == greedy.text, field
    assert run(temperature=1.5, seed=3)[0].text != greedy.text  # (else the above says nothing)
    # Penalties on what was already written change the greedy continuation.
    for field in ({"repetition_penalty": 1.5}, {"presence_penalty": 2.0},
                  {"frequency_penalty": 2.0}):
        assert run(temperature=0, **field)[0].text != greedy.text, field
    # A stop token ends the output where it is sampled; min_tokens holds it back until then.
    forced = {"logit_bias": {"77": 100.0}, "stop_token_ids": [77]}
    choice, n = run(temperature=0, **forced)
    assert (choice.finish_reason, n) == ("stop", 1)
    choice, n = run(temperature=0, min_tokens=5, **forced)
    assert choice.finish_reason == "stop" and n == 6, (choice, n)
    assert run(temperature=0, priority=0)[0].text == greedy.text


def test_sse_wire_format(drained: Served) -> None:
    with httpx.stream("POST", f"{drained.url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        json.loads(line[len("data: "):])


def test_misc_endpoints(any_mode: Served) -> None:
    url = any_mode.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    models = client(any_mode).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "Hello world" in detok["prompt"]
    # Administrative endpoints are off unless enabled (the keyed server enables them).
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 404
    admin = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{any_mode.key_url}/reset_prefix_cache?reset_running_requests=false",
                   headers=admin)
    assert r.status_code == 200 and r.json()["success"] is True
    r = httpx.post(f"{any_mode.key_url}/reset_prefix_cache?reset_running_requests=true",
                   headers=admin)
    assert r.status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("slotserve:num_requests_running", "slotserve:num_requests_waiting",
                 "slotserve:num_paused_sessions", "slotserve:kv_cache_usage_perc",
                 "slotserve:prefix_cache_queries_total", "slotserve:prefix_cache_hits_total",
                 "slotserve:num_preemptions_total", "slotserve:prompt_tokens_total",
                 "slotserve:generation_tokens_total", "slotserve:time_to_first_token_seconds",
                 "slotserve:inter_token_latency_seconds", "slotserve:e2e_request_latency_seconds",
                 "slotserve:request_queue_time_seconds"):
        assert name in metrics, name
    values = scrape(url)
    # Memory: the weights and the KV cache the engine holds, both processes' resident sets.
    assert values["slotserve:model_weights_bytes"] > 0
    assert values["slotserve:kv_cache_bytes"] > 0
    assert values["slotserve:engine_resident_memory_bytes"] > values[
        "slotserve:model_weights_bytes"]
    assert values["process_resident_memory_bytes"] > 0
