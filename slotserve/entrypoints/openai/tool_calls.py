"""Tool calling: the grammar that constrains a chat reply to valid calls, and the parser that
turns the reply back into OpenAI `tool_calls` (whole, or as streamed deltas).

A tool-call format is the way a model family writes calls, as its chat template shows it:

- `hermes` (Qwen 2.5 / 3 and other Hermes-style templates): text, then one or more
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, one per line;
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole reply is one call, or several
  joined by "; ", as `{"name": ..., "parameters": {...}}`; a reply that does not start with
  `{` is text.

The grammar (Lark with inline JSON schemas, as llguidance reads it) follows the format
exactly, so the parser never meets anything else: with `tool_choice="required"` or a named
function the reply is calls only; with `"auto"` it is free text until the format's call marker
(`<tool_call>`, or a leading `{`), and a call once begun is held to its function's parameter
schema, so every call returned parses and validates. Calls are written as Jinja's `tojson`
writes them into the template (", " and ": " between items, no other whitespace), which keeps
them close to what the model saw in training and bounded by the schema alone.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from slotserve.errors import RequestValidationError
from slotserve.structured_output.budget import check_schema_budget
from slotserve.structured_output.grammar import grammar_error, json_schema_grammar

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
Mode = Literal["auto", "required", "named"]
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]


def check_tools(tools: list[tuple[str, dict[str, Any] | None]]) -> list[Tool]:
    """Named, unique functions whose parameters are object schemas llguidance accepts;
    RequestValidationError (param "tools") otherwise."""
    out: list[Tool] = []
    seen: set[str] = set()
    for i, (name, parameters) in enumerate(tools):
        where = f"tools[{i}].function"
        if not TOOL_NAME.fullmatch(name):
            raise RequestValidationError(
                f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                "tools")
        if name in seen:
            raise RequestValidationError(f"{where}.name {name!r} is given twice", "tools")
        seen.add(name)
        if parameters is None:  # a function without arguments
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if parameters.get("type", "object") != "object":
            raise RequestValidationError(
                f"{where}.parameters must be a JSON schema of an object", "tools")
        check_schema_budget(parameters, "tools")
        error = grammar_error(json_schema_grammar(parameters))
        if error:
            raise RequestValidationError(
                f"{where}.parameters is not a valid JSON schema: {error.strip()}", "tools")
        out.append(Tool(name, parameters))
    return out


# ----------------------------------------------------------------------------- $ref

_LOCAL_DEFS = ("#/$defs/", "#/definitions/")


def hoist_definitions(tool: Tool, definitions: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameter schema as it must appear inside the calls schema, its local
    definitions moved into `definitions` (the calls schema's `$defs`).

    A tool schema's local references (`#/$defs/X`, `#/definitions/X`, what pydantic and the
    OpenAI SDK's `pydantic_function_tool` write; `#` or `#/properties/...` for the schema
    itself) point into the tool's own document, which is nested under the calls schema and no
    longer its root. So each definition becomes `$defs/<tool>.<X>` of the calls schema, the
    schema itself `$defs/<tool>` when something refers to it, and every reference is
    rewritten to match. A schema without references is returned as it is."""
    if not _has_ref(tool.parameters):
        return tool.parameters
    own = {k: v for k, v in tool.parameters.items() if k not in ("$defs", "definitions")}
    prefix = f"#/$defs/{tool.name}"
    for key in ("$defs", "definitions"):
        for name, sub in (tool.parameters.get(key) or {}).items():
            definitions[f"{tool.name}.{name}"] = _rewrite_refs(sub, tool.name)
    if _refers_to_root(tool.parameters):
        definitions[tool.name] = _rewrite_refs(own, tool.name)
        return {"$ref": prefix}
    rewritten: dict[str, Any] = _rewrite_refs(own, tool.name)
    return rewritten


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("$ref"), str) or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(_LOCAL_DEFS):
            return True
        return any(_refers_to_root(v) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    return False


def _rewrite_refs(node: Any, tool_name: str) -> Any:
    if isinstance(node, list):
        return [_rewrite_refs(v, tool_name) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, tool_name) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for local in _LOCAL_DEFS:
            if ref.startswith(local):
                out["$ref"] = f"#/$defs/{tool_name}.{ref[len(local):]}"
                break
        else:  # the tool's own schema, or a path inside it
            out["$ref"] = f"#/$defs/{tool_name}{ref[1:]}"
    return out


# ----------------------------------------------------------------------------- parsing

@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str = ""
    complete: bool = False
    id: str = field(default_factory=new_call_id)


@dataclass(slots=True)
class ToolCallDelta:
    """What one feed() added: content text, and per call index a start (name) and/or
    argument text."""

    content: str = ""
    started: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)


class ToolCallParser:
    """Incremental: feed() the reply's text as it comes; the deltas are what to stream.
    After the last feed, `content`, `calls` (complete ones) and `tail` (the text of a call cut
    short, by max_tokens) describe the whole reply."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.state = "start"
        self.pending = ""
        self.content = ""
        self.calls: list[ParsedCall] = []
        self._call_text = ""  # text of the call being parsed, marker included (`tail`)
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]

    @property
    def tail(self) -> str:
        """What the reply wrote after its last complete call: a call cut short (or only its
        marker), when max_tokens ended the reply there."""
        return "" if self.state in ("start", "text") else self._call_text + self.pending

    def feed(self, text: str) -> ToolCallDelta:
        delta = ToolCallDelta()
        self.pending += text
        while self.pending:
            before = (self.state, len(self.pending))
            getattr(self, f"_on_{self.state}")(delta)
            if (self.state, len(self.pending)) == before:
                break  # needs more text
        return delta

    def finish(self) -> ToolCallDelta:
        """The reply ended: text held back as a possible marker start is content after all."""
        delta = ToolCallDelta()
        if self.state in ("start", "text") and self.pending:
            self._emit_content(delta, self.pending)
            self.pending = ""
        return delta

    def _emit_content(self, delta: ToolCallDelta, text: str) -> None:
        self.content += text
        delta.content += text

    def _on_start(self, delta: ToolCallDelta) -> None:
        self.state = "text" if not self.fmt.starts_with_call(self.pending) else "open"

    def _on_text(self, delta: ToolCallDelta) -> None:
        marker = self.fmt.marker
        if marker is None:
            self._emit_content(delta, self.pending)
            self.pending = ""
            return
        at = self.pending.find(marker)
        if at >= 0:
            self._emit_content(delta, self.pending[:at])
            self.pending = self.pending[at + len(marker):]
            self._call_text = marker
            self.state = "open"
            return
        keep = _partial_suffix(self.pending, marker)
        self._emit_content(delta, self.pending[:len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]

    def _on_open(self, delta: ToolCallDelta) -> None:
        m = self.fmt.call_head.match(self.pending)
        if m is None:
            return
        call = ParsedCall(m.group(1))
        self.calls.append(call)
        delta.started[len(self.calls) - 1] = call.name
        self._call_text += m.group(0)
        self.pending = self.pending[m.end():]
        self._depth, self._in_string, self._escape = 0, False, False
        self.state = "args"

    def _on_args(self, delta: ToolCallDelta) -> None:
        call = self.calls[-1]
        end = None
        for i, ch in enumerate(self.pending):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        taken = self.pending[:end] if end is not None else self.pending
        call.arguments += taken
        self._call_text += taken
        index = len(self.calls) - 1
        delta.arguments[index] = delta.arguments.get(index, "") + taken
        self.pending = self.pending[len(taken):]
        if end is not None:
            self.state = "close"

    def _take(self, literal: str) -> bool:
        """Consume `literal` (the grammar puts it here) once all of it has arrived."""
        if len(self.pending) < len(literal):
            return False
        assert self.pending.startswith(literal), self.pending
        self.pending = self.pending[len(literal):]
        return True

    def _on_close(self, delta: ToolCallDelta) -> None:
        if self._take(self.fmt.call_close):
            self.calls[-1].complete = True
            self._call_text, self.state = "", "between"

    def _on_between(self, delta: ToolCallDelta) -> None:
        if self._take(self.fmt.call_separator):
            self._call_text, self.state = self.fmt.call_separator, "open"


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that begins the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ----------------------------------------------------------------------------- formats

class ToolCallFormat(ABC):
    name: ClassVar[str]
    # The key of the arguments object in a call.
    args_key: ClassVar[str]
    # Text that opens the first call in auto mode (None: a call is the whole reply).
    marker: ClassVar[str | None]
    # What follows a call's JSON, and what separates two calls.
    call_close: ClassVar[str]
    call_separator: ClassVar[str]
    # A call's start up to its arguments object (set per format from args_key): matched on
    # every token while a call's head arrives, so compiled once.
    call_head: ClassVar[re.Pattern[str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "args_key" in cls.__dict__:
            cls.call_head = re.compile(r'\{"name": "(' + TOOL_NAME.pattern + r')", "'
                                       + re.escape(cls.args_key) + r'": ')

    def starts_with_call(self, text: str) -> bool:
        return False

    def calls_schema(self, tools: list[Tool]) -> dict[str, Any]:
        definitions: dict[str, Any] = {}
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.name},
                                 self.args_key: hoist_definitions(t, definitions)},
                  "required": ["name", self.args_key], "additionalProperties": False}
                 for t in tools]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if definitions:
            schema = {**schema, "$defs": definitions}
        return {**schema, "x-guidance": CALL_JSON_OPTIONS}

    @abstractmethod
    def grammar(self, tools: list[Tool], mode: Mode, parallel: bool) -> str:
        """The Lark grammar of a reply (named mode: `tools` holds the one function)."""

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


class HermesFormat(ToolCallFormat):
    name = "hermes"
    args_key = "arguments"
    marker = "<tool_call>\n"
    call_close = "}\n</tool_call>"
    call_separator = "\n<tool_call>\n"

    def __init__(self, tag_tokens: bool = False) -> None:
        """`tag_tokens`: the tokenizer has <tool_call> and </tool_call> as tokens of their own
        (Qwen's do), which the model writes and the grammar must name as such (llguidance
        treats added <...> tokens as special, apart from the characters that spell them)."""
        self.open_tag, self.close_tag = (("<tool_call>", "</tool_call>") if tag_tokens else
                                         ('"<tool_call>"', '"</tool_call>"'))

    def grammar(self, tools: list[Tool], mode: Mode, parallel: bool) -> str:
        more = f' ("\\n" {self.open_tag} "\\n" call)*' if parallel and mode != "named" else ""
        rules = [
            f"calls: call{more}",
            f'call: call_json "\\n" {self.close_tag}',
            f"call_json: %json {json.dumps(self.calls_schema(tools))}",
        ]
        if mode == "auto":
            # Free text that never spells the tag, or text up to the first tag (the lazy
            # rule ends there) and the calls.
            rules[:0] = ["start: TEXT | head calls",
                         f'head[lazy]: ANY {self.open_tag} "\\n"',
                         "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                         "ANY: /(?s:.*)/"]
            if self.open_tag.startswith("<"):
                # A tag token ends the text lexeme by itself; a lazy rule cannot hold one.
                rules[1] = f'head: TEXT {self.open_tag} "\\n"'
        else:
            rules.insert(0, f'start: {self.open_tag} "\\n" calls')
        return "\n".join(rules)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    args_key = "parameters"
    marker = None
    call_close = "}"
    call_separator = "; "

    def starts_with_call(self, text: str) -> bool:
        return text.startswith("{")

    def grammar(self, tools: list[Tool], mode: Mode, parallel: bool) -> str:
        more = ' ("; " call)*' if parallel and mode != "named" else ""
        rules = [f"calls: call{more}", f"call: %json {json.dumps(self.calls_schema(tools))}"]
        if mode == "auto":
            rules[:0] = ["start: TEXT | calls", "TEXT: /([^{](?s:.*))?/"]
        else:
            rules.insert(0, "start: calls")
        return "\n".join(rules)


def detect_format(chat_template: str | None, flag: str | None = None,
                  added_vocab: Mapping[str, int] | None = None) -> ToolCallFormat | None:
    """The format named by the flag (`--tool-call-parser`), else the one the chat template
    writes calls in, else None. `added_vocab` is the tokenizer's added tokens (Hermes tags
    may be tokens of their own)."""
    template = chat_template or ""
    if flag is None:
        if "<tool_call>" in template:
            flag = "hermes"
        elif "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
            flag = "llama3_json"
        else:
            return None
    if flag == "hermes":
        added = added_vocab or {}
        return HermesFormat(tag_tokens="<tool_call>" in added and "</tool_call>" in added)
    if flag == "llama3_json":
        return Llama3JsonFormat()
    raise ValueError(f"unknown tool-call format {flag!r}; known: hermes, llama3_json")
