"""A request's constraint (StructuredOutputsParams) as one llguidance grammar text.

The text is the cache key of a compiled grammar and what crosses from the engine's front to
its core. Built and checked in the front, before a request reaches the core, so a malformed
schema, an unsupported regex feature or a broken Lark grammar is a RequestValidationError
(HTTP 400) naming the field, with the library's message.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from slotserve.errors import RequestValidationError
from slotserve.sampling_params import StructuredOutputsParams
from slotserve.structured_output.budget import check_regex_budget, check_schema_budget
from slotserve.structured_output.limits import error_excerpt, parser_limits

if TYPE_CHECKING:
    import llguidance


def _matcher() -> type[llguidance.LLMatcher]:
    """llguidance's matcher, imported at the first constraint: the server's front imports
    this module with the tool parsers, and most servers never see a grammar."""
    import llguidance

    return llguidance.LLMatcher


def json_schema_grammar(schema: dict[str, Any], *, compact: bool = True) -> str:
    """Compact: JSON written with the schema's structure only, no whitespace between tokens
    (a schema may still ask for more in its "x-guidance" options)."""
    return _matcher().grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": not compact})


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text` (Lark reads JSON's escapes)."""
    return json.dumps(text)


def _schema(spec: StructuredOutputsParams) -> dict[str, Any]:
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestValidationError(f"the JSON schema is not valid JSON: {exc}",
                                         "structured_outputs.json") from exc
        except RecursionError:
            raise RequestValidationError("the JSON schema nests too deeply",
                                         "structured_outputs.json") from None
    if not isinstance(schema, dict):
        raise RequestValidationError("a JSON schema must be an object",
                                     "structured_outputs.json")
    check_schema_budget(schema, "structured_outputs.json")
    return schema


def grammar_text(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(the llguidance grammar, the field it came from) for one constraint."""
    compact = spec.disable_any_whitespace
    if spec.json is not None:
        try:
            return (json_schema_grammar(_schema(spec), compact=compact),
                    "structured_outputs.json")
        except ValueError as exc:
            raise RequestValidationError(f"invalid JSON schema: {exc}",
                                         "structured_outputs.json") from exc
    if spec.json_object:
        return json_schema_grammar({"type": "object"}, compact=compact), \
            "structured_outputs.json_object"
    if spec.regex is not None:
        check_regex_budget(spec.regex, "structured_outputs.regex")
        return _matcher().grammar_from_regex(spec.regex), "structured_outputs.regex"
    if spec.choice is not None:
        lark = "start: " + " | ".join(lark_string(c) for c in spec.choice)
        return _matcher().grammar_from_lark(lark), "structured_outputs.choice"
    assert spec.grammar is not None  # StructuredOutputsParams holds exactly one
    return _matcher().grammar_from_lark(spec.grammar), "structured_outputs.grammar"


_VALIDATED: OrderedDict[int, str] = OrderedDict()  # hash of the text -> its complaint
_VALIDATED_MAX = 1024
_validated_lock = threading.Lock()


def grammar_error(grammar: str) -> str:
    """The library's complaint about a grammar ('' when it is valid), without a tokenizer:
    syntax, schema and regex features, the parser limits the core compiles with, as a bounded
    excerpt. Remembered by the text's hash (clients resend the same schema; keeping the texts
    could hold a GB of them)."""
    key = hash(grammar)
    with _validated_lock:
        if key in _VALIDATED:
            _VALIDATED.move_to_end(key)
            return _VALIDATED[key]
    error = _matcher().validate_grammar(grammar, limits=parser_limits())
    error = error_excerpt(error) if error else ""
    with _validated_lock:
        _VALIDATED[key] = error
        while len(_VALIDATED) > _VALIDATED_MAX:
            _VALIDATED.popitem(last=False)
    return error


# The last constraints checked, by identity: the API checks a request's constraint on the
# grammar-check thread, then the processor (on a front thread) finds the text here instead of
# building it again (0.1 to 1 s for a large schema).
_CHECKED: OrderedDict[int, tuple[StructuredOutputsParams, str]] = OrderedDict()
_CHECKED_MAX = 16


def checked_grammar(spec: StructuredOutputsParams) -> str:
    """The grammar text of a constraint, or RequestValidationError with the library's
    message naming the field."""
    with _validated_lock:
        hit = _CHECKED.get(id(spec))
        if hit is not None and hit[0] is spec:
            return hit[1]
    grammar, param = grammar_text(spec)
    error = grammar_error(grammar)
    if error:
        raise RequestValidationError(f"invalid {param.rsplit('.', 1)[-1]} constraint: "
                                     f"{error}", param)
    with _validated_lock:
        _CHECKED[id(spec)] = (spec, grammar)
        while len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    return grammar
