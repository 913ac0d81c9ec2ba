"""What checking one constraint may cost the front, counted before llguidance sees it.

llguidance's validation of a JSON schema grows faster than linearly with the properties of an
object (measured on a 2-core machine under load: 250 optional properties 0.2 s, 1,000 1.6 s,
2,000 3.4 s; the chaos benchmark's 0.9 MB schema with 12,000 took 6 s unloaded and 109 s
loaded), and a Rust call cannot be stopped once it runs. So a schema is measured first, in
one pass without recursion (a schema nested 100,000 deep costs no stack): past the budget it
is a 400 at once, naming what was too large. What fits the budget is validated on the one
thread of `grammar_check_pool()`, never on the front's threads that tokenize: four large
schemas then wait for each other, not every plain request for them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from slotserve.errors import RequestValidationError

# Subschemas (JSON objects) in one schema; real API schemas have tens to a few hundred.
MAX_SCHEMA_NODES = 5_000
# Properties of one object schema (the superlinear part of llguidance's work).
MAX_OBJECT_PROPERTIES = 1_000

_pool: concurrent.futures.ThreadPoolExecutor | None = None
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
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > MAX_OBJECT_PROPERTIES:
                raise RequestValidationError(
                    f"an object in the JSON schema has {len(props)} properties, more than "
                    f"the limit of {MAX_OBJECT_PROPERTIES}", param)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def grammar_check_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that checks constraints (llguidance drops the GIL while it validates),
    apart from the front's threads that parse and tokenize."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="slotserve-grammar-check")
        return _pool
