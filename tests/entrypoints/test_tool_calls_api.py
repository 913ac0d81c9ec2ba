"""Tool calling through the server with the official `openai` client, in every tool_choice
mode, for both tool-call formats: Hermes `<tool_call>` blocks (a Qwen-like tokenizer with the
tags as tokens of their own) and Llama 3 JSON calls.

The models are bigram checkpoints (tests/helpers.build_bigram_model), random but for a few
scripted successions, so a test decides what the model writes where the grammar leaves a
choice: after the generation prompt it writes "OK" and then a tool-call tag (Hermes) or a
"{" (Llama 3); after "Y" it writes "es" and ends. Everything else (argument keys and values,
the choice among functions) is the random part, held to the schemas by the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import LoopThread, Served, start_server
from tests.helpers import TOKENIZER_EOS, build_bigram_model
from tests.structured_output.templates import HERMES_TEMPLATE, LLAMA3_JSON_TEMPLATE

MODEL = "tools"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["C", "F"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "noop"}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "noop": {"type": "object",
                                                        "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(loop: LoopThread, folder: Path) -> Iterator[Served]:
    engine = AsyncLLM.from_engine_args(model=str(folder), engine_mode="thread", threads=1,
                                       dtype="float32", device="cpu", max_model_len=2048,
                                       num_blocks=1100, max_num_seqs=8, check=True, seed=0)
    server = start_server(loop, build_app(engine, served_model_names=[MODEL],
                                          shutdown_engine=False))
    try:
        yield Served(loop, engine, server.base_url, server.base_url)
    finally:
        server.stop()
        engine.shutdown()


def last_prompt_token(tokenizer: Any) -> int:
    ids = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                        tokenize=False)
    return int(tokenizer.encode(ids, add_special_tokens=False)[-1])


def script(tokenizer: Any, first: list[int]) -> list[list[int]]:
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return [[last_prompt_token(tokenizer), *first], enc("Y") + enc("es") + [TOKENIZER_EOS]]


@pytest.fixture(scope="module")
def hermes(loop_thread: LoopThread, tokenizer_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # as in Qwen's vocabulary
    tok.chat_template = HERMES_TEMPLATE
    open_tag, close_tag = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    chains = script(tok, tok.encode("OK", add_special_tokens=False) + [open_tag])
    chains.append([close_tag, TOKENIZER_EOS])
    folder = tmp_path_factory.mktemp("hermes_model")
    build_bigram_model(folder, tok, chains)
    yield from serve(loop_thread, folder)


@pytest.fixture(scope="module")
def llama3(loop_thread: LoopThread, tokenizer_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = LLAMA3_JSON_TEMPLATE
    folder = tmp_path_factory.mktemp("llama3_model")
    build_bigram_model(folder, tok, script(tok, tok.encode("{", add_special_tokens=False)))
    yield from serve(loop_thread, folder)


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def check_calls(calls: Any, names: set[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        name = call.function.name
        assert name in (names or SCHEMAS)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[name])
        out.append((name, arguments))
    return out


def streamed(served: Served, **kw: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """Content, calls (reassembled from their deltas as a client does) and finish reason."""
    content, calls, finish = "", [], None
    for chunk in client(served).chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index == len(calls):
                assert d.id and d.function.name and d.type == "function"
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.fixture(params=["hermes", "llama3"])
def tool_server(request: pytest.FixtureRequest) -> Served:
    served: Served = request.getfixturevalue(request.param)
    return served


def test_auto_writes_text_then_a_valid_call(tool_server: Served, request: Any) -> None:
    hermes = "hermes" in request.node.name
    for parallel in (False, True):
        kw: dict[str, Any] = dict(messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                  parallel_tool_calls=parallel)
        out = client(tool_server).chat.completions.create(model=MODEL, **kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(calls) == 1
        assert choice.message.content == ("OK" if hermes else None)
        content, deltas, finish = streamed(tool_server, **kw)
        assert finish == "tool_calls" and content == (choice.message.content or "")
        assert [(d["name"], json.loads(d["arguments"])) for d in deltas] == calls
        assert [d["arguments"] for d in deltas] == [
            c.function.arguments for c in choice.message.tool_calls]


def test_auto_can_answer_with_text(tool_server: Served) -> None:
    # The reply continues an assistant turn that begins "Y": the model writes "es" and ends.
    messages = [*ASK, {"role": "assistant", "content": "Y"}]
    kw: dict[str, Any] = dict(messages=messages, tools=TOOLS, max_tokens=20, temperature=0,
                              extra_body={"add_generation_prompt": False,
                                          "continue_final_message": True})
    out = client(tool_server).chat.completions.create(model=MODEL, **kw)
    assert out.choices[0].message.content == "es" and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    assert streamed(tool_server, **kw) == ("es", [], "stop")


def test_required_and_named_calls_validate(tool_server: Served) -> None:
    c = client(tool_server)
    out = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150,
                                    tool_choice="required", n=4, temperature=1.0, seed=3)
    finished = [ch for ch in out.choices if ch.finish_reason == "tool_calls"]
    assert len(finished) >= 2
    for ch in finished:
        check_calls(ch.message.tool_calls)
        assert ch.message.content is None
    for name in ("add", "noop", "get_weather"):
        kw: dict[str, Any] = dict(messages=ASK, tools=TOOLS, max_tokens=80, temperature=0.7,
                                  seed=1, tool_choice={"type": "function",
                                                       "function": {"name": name}})
        out = c.chat.completions.create(model=MODEL, **kw)
        assert out.choices[0].finish_reason == "tool_calls"
        assert [n for n, _ in check_calls(out.choices[0].message.tool_calls, {name})] == [name]
        _, deltas, finish = streamed(tool_server, **kw)
        assert finish == "tool_calls" and [d["name"] for d in deltas] == [name]
        jsonschema.validate(json.loads(deltas[0]["arguments"]), SCHEMAS[name])


def test_tool_choice_none_leaves_the_reply_free(hermes: Served) -> None:
    out = client(hermes).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 tool_choice="none", max_tokens=12,
                                                 temperature=0)
    message = out.choices[0].message
    assert not message.tool_calls and message.content.startswith("OK<tool_call>")
    assert out.choices[0].finish_reason in ("stop", "length")


def test_length_cut_call_is_not_returned_as_a_call(hermes: Served) -> None:
    out = client(hermes).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    # Dropped, markup and all: the tool-call format never leaks into the content.
    assert "<tool_call>" not in (choice.message.content or "") and "{" not in (
        choice.message.content or "")


def test_tool_results_go_through_the_chat_template(hermes: Served) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    rendered = httpx.post(f"{hermes.url}/tokenize", json={"messages": history}).json()
    text = httpx.post(f"{hermes.url}/detokenize", json={"tokens": rendered["tokens"]}).json()
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text["prompt"]
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text["prompt"]
    out = client(hermes).chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                 max_tokens=100, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls)
    bad = [*history[:1], {**history[1], "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{not json"}}]}]
    r = httpx.post(f"{hermes.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": bad, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
