"""Tool-call formats without a model: which format a chat template shows, the grammar of each
tool_choice mode, and the parser reading back what the grammar lets a model write (a random
walk over the allowed tokens of real llguidance matchers), whole and in pieces."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest

from slotserve.entrypoints.openai.tool_calls import (
    HermesFormat,
    Llama3JsonFormat,
    ToolCallFormat,
    check_tools,
    detect_format,
)
from slotserve.errors import RequestValidationError
from tests.structured_output.templates import HERMES_TEMPLATE, LLAMA3_JSON_TEMPLATE

WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = check_tools([("get_weather", WEATHER), ("noop", None)])


def test_the_format_comes_from_the_template_or_the_flag() -> None:
    assert isinstance(detect_format(HERMES_TEMPLATE), HermesFormat)
    assert isinstance(detect_format(LLAMA3_JSON_TEMPLATE), Llama3JsonFormat)
    assert detect_format("{{ messages }}") is None
    assert isinstance(detect_format("{{ messages }}", "llama3_json"), Llama3JsonFormat)
    tagged = detect_format(HERMES_TEMPLATE, None, {"<tool_call>": 7, "</tool_call>": 8})
    assert isinstance(tagged, HermesFormat) and tagged.open_tag == "<tool_call>"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        detect_format(None, "xml")


def test_tools_are_checked() -> None:
    for tools, match in [([("a b", None)], "letters"), ([("f", None), ("f", None)], "twice"),
                         ([("f", {"type": "array"})], "object"),
                         ([("f", {"type": "object", "properties": {"x": {"type": 3}}})],
                          "not a valid JSON schema")]:
        with pytest.raises(RequestValidationError, match=match) as info:
            check_tools(tools)  # type: ignore[arg-type]
        assert info.value.param == "tools"


def walk(tokenizer: Any, grammar: str, seed: int, prefer: list[int]) -> tuple[str, bool]:
    """A 'model' that picks allowed tokens at random (preferring some), to the grammar's end."""
    vocab = len(tokenizer)
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[1])
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    rng, out = random.Random(seed), []
    for _ in range(300):
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.nonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))[0]
        options = [t for t in prefer if t in allowed]
        token = (1 if 1 in allowed and rng.random() < 0.2 else
                 options[0] if options and rng.random() < 0.5 else int(rng.choice(allowed)))
        assert matcher.consume_token(token)
        out.append(token)
        if matcher.is_stopped():
            return tokenizer.decode(out, skip_special_tokens=True), True
    return tokenizer.decode(out, skip_special_tokens=True), False


@pytest.mark.parametrize(("fmt_name", "tag_tokens"), [
    ("hermes", False), ("hermes", True), ("llama3_json", False)],
    ids=["hermes-text-tags", "hermes-tag-tokens", "llama3_json"])
def test_every_mode_parses_back(tokenizer: Any, fmt_name: str, tag_tokens: bool) -> None:
    if tag_tokens:  # Qwen's vocabulary has the tags as tokens of their own
        tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    fmt: ToolCallFormat = detect_format(None, fmt_name, tokenizer.get_added_vocab())
    opener = "<tool_call>" if fmt_name == "hermes" else "{"
    prefer = tokenizer.encode(opener, add_special_tokens=False)[:1]
    calls_seen = 0
    for mode, parallel in [("auto", True), ("auto", False), ("required", True),
                           ("required", False), ("named", False)]:
        tools = TOOLS[:1] if mode == "named" else TOOLS
        for seed in range(3):
            text, complete = walk(tokenizer, fmt.grammar(tools, mode, parallel), seed, prefer)
            whole, pieces = fmt.parser(), fmt.parser()
            whole.feed(text)
            whole.finish()
            rng, i, streamed = random.Random(seed), 0, {}
            while i < len(text):
                k = rng.randint(1, 7)
                for index, args in pieces.feed(text[i:i + k]).arguments.items():
                    streamed[index] = streamed.get(index, "") + args
                i += k
            pieces.finish()
            assert [(c.name, c.arguments) for c in whole.complete_calls] == [
                (c.name, c.arguments) for c in pieces.complete_calls]
            assert whole.content == pieces.content
            for index, call in enumerate(whole.complete_calls):
                schema = WEATHER if call.name == "get_weather" else {"maxProperties": 0}
                jsonschema.validate(json.loads(call.arguments), schema)
                assert streamed[index] == call.arguments
            calls_seen += len(whole.complete_calls)
            if complete and mode != "auto":
                assert whole.complete_calls and not whole.tail and not whole.content
                if not parallel or mode == "named":
                    assert len(whole.complete_calls) == 1
    assert calls_seen >= 10


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3JsonFormat()])
def test_a_call_cut_short_leaks_no_markup_into_the_content(fmt: ToolCallFormat) -> None:
    """Five complete calls and a sixth that max_tokens cut inside its head: five calls come
    back, and the content holds none of the format's markup (the cut call is dropped)."""
    from slotserve.entrypoints.openai.serving_chat import _reply
    from slotserve.entrypoints.openai.structured import ToolContext

    call = '{"name": "noop", "' + fmt.args_key + '": {}}'
    first = (fmt.marker or "") + call
    text = first + "".join(fmt.call_close[1:] + fmt.call_separator + call
                           for _ in range(4)) + fmt.call_close[1:] + fmt.call_separator + '{"name'
    message, finish = _reply(ToolContext([], fmt, None), text, "length")
    assert [c.function.name for c in message.tool_calls] == ["noop"] * 5 and finish == "length"
    assert not message.content, message.content
