"""From an API request to the constraint its reply must keep: OpenAI's `response_format`,
vLLM's `structured_outputs` extra field, or (chat) the grammar of its `tools` and
`tool_choice`. Every problem is a 400 naming the field the client sent: the constraint
carries its name (StructuredOutputsParams.param), so the engine's own refusals name it too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from slotserve.entrypoints.openai.errors import APIError, bad_request, from_exception
from slotserve.entrypoints.openai.protocol_structured import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolChoice,
)
from slotserve.entrypoints.openai.tool_calls import ToolCallFormat, ToolCallParser, check_tools
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from slotserve.structured_output.budget import grammar_check_pool
from slotserve.structured_output.grammar import checked_grammar

T = TypeVar("T")


async def on_grammar_thread(fn: Callable[[], T], client: str) -> T:
    """fn() on the threads that check constraints (structured_output.budget), in `client`'s
    turn, not on the front's threads that tokenize: a large schema's validation holds up only
    its own client's other constraints. The grammar text it builds (`checked_grammar`) is
    found again, not rebuilt, when the request is processed."""
    return await asyncio.wrap_future(grammar_check_pool().submit(fn, client=client))


async def check_constraint(constraint: StructuredOutputsParams,
                           response_format: ResponseFormat | None, client: str) -> None:
    """Build and validate `constraint` on the grammar-check threads in `client`'s turn (a 400
    named by the field the client sent when it is invalid)."""
    def check() -> None:
        try:
            checked_grammar(constraint)
        except RequestValidationError as exc:
            raise rename_param(from_exception(exc), response_format) from exc

    await on_grammar_thread(check, client)


def response_constraint(response_format: ResponseFormat | None,
                        structured_outputs: StructuredOutputsRequest | None
                        ) -> StructuredOutputsParams | None:
    if response_format is not None and response_format.type != "text":
        if structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both",
                              "response_format")
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format")
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format.json_schema")
        return StructuredOutputsParams(json=spec.json_schema, param="response_format")
    if structured_outputs is None:
        return None
    return structured_outputs.to_params()


def rename_param(err: APIError, response_format: ResponseFormat | None) -> APIError:
    """An engine error about the constraint, named by the field the client sent."""
    if (err.param or "").startswith("structured_outputs") and response_format is not None:
        err.param = "response_format"
    return err


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a chat request with tools needs: the tools for the chat template, and unless
    tool_choice is "none", the format to parse the reply with and its grammar."""

    template_tools: list[dict[str, Any]]
    fmt: ToolCallFormat | None
    constraint: StructuredOutputsParams | None

    def parser(self) -> ToolCallParser | None:
        return self.fmt.parser() if self.fmt is not None else None


def tool_context(tools: list[ChatCompletionToolsParam] | None, tool_choice: ToolChoice | None,
                 parallel_tool_calls: bool, fmt: ToolCallFormat | None) -> ToolContext | None:
    if not tools:
        if tool_choice is not None and tool_choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    checked = check_tools([(t.function.name, t.function.parameters) for t in tools])
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolContext(template_tools, None, None)
    named = None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        named = [t for t in checked if t.name == choice.function.name]
        if not named:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not "
                              "among the tools", "tool_choice")
    if fmt is None:
        raise bad_request("this model's chat template has no tool-call format that slotserve "
                          "knows; start the server with --tool-call-parser hermes or "
                          "llama3_json", "tools")
    if named is not None:
        grammar = fmt.grammar(named, "named", False)
    else:
        assert choice in ("auto", "required")
        grammar = fmt.grammar(checked, "auto" if choice == "auto" else "required",
                              parallel_tool_calls)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"the tools' parameter schemas make a grammar of {len(grammar)} "
                          f"characters, more than the limit of {MAX_GRAMMAR_CHARS}: send fewer "
                          "or smaller tools", "tools")
    return ToolContext(template_tools, fmt, StructuredOutputsParams(grammar=grammar,
                                                                    param="tools"))
