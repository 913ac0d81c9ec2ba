"""Large request bodies decoded apart from the threads that tokenize.

A 0.7 MB JSON schema in a body took pydantic's `model_validate_json` 94 ms (strict mode,
`str | dict[str, Any]` fields), holding the GIL, on one of the front's two threads that
tokenize every request: four clients sending such bodies kept plain completions waiting
behind them (p99 8-10x). Parsing with pydantic_core's `from_json` (Rust, no Python frames)
and then validating the Python objects is faster than both that and `json.loads`, so a
large body is decoded that way, on one thread of its own (the large bodies wait for each
other, not the tokenizer for them). Strict validation of Python objects accepts no more than
strict validation of JSON does, so when it refuses a body the body is validated again as
JSON, for exactly the verdict and messages a small body gets.

Nesting: `from_json` (and `model_validate_json`) stop at a depth of about 200 with
"recursion limit exceeded"; that is a 400 `too_deep` on both paths (errors.py maps the
small-body one), never a RecursionError from walking the objects later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError

from slotserve.entrypoints.openai.errors import bad_request, too_deep

M = TypeVar("M", bound=BaseModel)

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _body_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slotserve-body")
        return _pool


def decode_body(model: type[M], body: bytes) -> M:
    """`model.model_validate_json(body)`, in less time for a large nested body.
    ValidationError as model_validate_json raises it; a body that is not JSON a 400
    (invalid_json), one nested past the parser's depth limit a 400 (too_deep)."""
    try:
        # NaN and Infinity are not JSON (nor accepted by model_validate_json).
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:  # not JSON, not UTF-8, too deep
        if "recursion limit" in str(exc):
            raise too_deep() from None
        raise bad_request(f"invalid JSON body: {exc}", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError:
        return model.model_validate_json(body)  # the JSON verdict and messages


async def decode_large_body(model: type[M], body: bytes) -> M:
    """decode_body on the body thread."""
    return await asyncio.wrap_future(_body_pool().submit(decode_body, model, body))
