"""What checking one constraint may cost the front, counted before llguidance sees it.

llguidance's validation of a JSON schema grows faster than linearly with the properties of an
object (measured on a 2-core machine under load: 250 optional properties 0.2 s, 1,000 1.6 s,
2,000 3.4 s; the chaos benchmark's 0.9 MB schema with 12,000 took 6 s unloaded and 109 s
loaded), and a Rust call cannot be stopped once it runs. So a schema is measured first, in
one pass without recursion (a schema nested 100,000 deep costs no stack): past the budget it
is a 400 at once, naming what was too large (also an object with more optional properties
than llguidance's parser can follow, which the engine's compile would refuse only after
building the grammar). What fits the budget is validated on the one
thread of `grammar_check_pool()`, never on the front's threads that tokenize: four large
schemas then wait for each other, not every plain request for them.
"""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any

from slotserve.errors import RequestValidationError
from slotserve.structured_output.compile_queue import FairCompileExecutor
from slotserve.structured_output.limits import MAX_LEXER_STATES

# The stdlib's regex parser (what `re` compiles with; untyped, Python 3.11+).
sre_parse: Any = importlib.import_module("re._parser")

# Subschemas (JSON objects) in one schema; real API schemas have tens to a few hundred.
MAX_SCHEMA_NODES = 5_000
# Properties of one object schema (the superlinear part of llguidance's work).
MAX_OBJECT_PROPERTIES = 1_000
# Optional properties of one object: where one may come, any later one may come instead, so
# the parser's row there holds about 4 Earley items per optional property, and llguidance
# fails a row past `max_items_in_row` (2,000) when the engine compiles (499 optional
# properties fail at the first token). Refused here, before any llguidance call, with room
# to spare for property schemas that add items of their own.
MAX_OPTIONAL_PROPERTIES = 450
# Longest regex whose counted repetitions are measured (parsing takes ~4 us a character).
MAX_PARSED_PATTERN_CHARS = 10_000
_COUNTED = re.compile(r"\{\s*\d")

_pool: FairCompileExecutor | None = None
_pool_lock = threading.Lock()


def check_schema_budget(schema: Any, param: str) -> None:
    """RequestValidationError (naming `param`) when `schema` is over the budget."""
    stack: list[Any] = [schema]
    nodes = 0
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            nodes += 1
            if nodes > MAX_SCHEMA_NODES:
                raise RequestValidationError(
                    f"the JSON schema has more than {MAX_SCHEMA_NODES} subschemas, the limit",
                    param)
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex_budget(pattern, param)
            props = node.get("properties")
            if isinstance(props, dict):
                check_properties_budget(props, node.get("required"), param)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def check_properties_budget(props: dict[str, Any], required: Any, param: str) -> None:
    """RequestValidationError when one object has more properties, or more optional ones,
    than the budget allows."""
    if len(props) > MAX_OBJECT_PROPERTIES:
        raise RequestValidationError(
            f"an object in the JSON schema has {len(props)} properties, more than the limit "
            f"of {MAX_OBJECT_PROPERTIES}", param)
    if len(props) <= MAX_OPTIONAL_PROPERTIES:
        return
    names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    optional = sum(1 for name in props if name not in names)
    if optional > MAX_OPTIONAL_PROPERTIES:
        raise RequestValidationError(
            f"an object in the JSON schema has {optional} optional properties, more than the "
            f"limit of {MAX_OPTIONAL_PROPERTIES} (the grammar library follows at most 2,000 "
            "alternatives at one point of the output, about 4 per optional property): "
            "list more of them in `required`, or split the object", param)


def check_regex_budget(pattern: str, param: str) -> None:
    """RequestValidationError when every match of `pattern` needs more counted repetitions
    than the lexer may have states (`^((a{100}){100}){100}$`: 10^6 characters, each a state
    of its own): llguidance would build lexer states for 10-16 s before it gives up. Read
    with Python's regex parser (Python code, holding the GIL: only patterns with a counted
    repetition, up to MAX_PARSED_PATTERN_CHARS); a pattern it does not read is left to
    llguidance."""
    if len(pattern) > MAX_PARSED_PATTERN_CHARS or not _COUNTED.search(pattern):
        return
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    if _min_length(list(tree), MAX_LEXER_STATES) > MAX_LEXER_STATES:
        raise RequestValidationError(
            f"every match of the regex {pattern[:60]!r} needs more than {MAX_LEXER_STATES} "
            "characters of counted repetitions, more than the grammar library's lexer may "
            "follow", param)


def _min_length(items: list[Any], cap: int) -> int:
    """The shortest match's length (capped just above `cap`), iteratively enough: nesting
    is as deep as the pattern's groups."""
    total = 0
    for op, arg in items:
        name = str(op)
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN", "CATEGORY", "RANGE"):
            total += 1
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _, sub = arg
            if low:
                total += low * _min_length(list(sub), cap)
        elif name == "SUBPATTERN":
            total += _min_length(list(arg[-1]), cap)
        elif name == "ATOMIC_GROUP":
            total += _min_length(list(arg), cap)
        elif name == "BRANCH":
            total += min((_min_length(list(b), cap) for b in arg[1]), default=0)
        if total > cap:
            return cap + 1
    return total


def grammar_check_pool() -> FairCompileExecutor:
    """The threads that check constraints (llguidance drops the GIL while it validates),
    apart from the front's threads that parse and tokenize: two, at most one per client at
    a time, round-robin over clients, so one client's large schemas do not hold up another
    client's small regex here either."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = FairCompileExecutor("slotserve-grammar-check")
        return _pool
