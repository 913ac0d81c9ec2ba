"""A large body's constraints measured in a process of its own, before the front decodes it.

Decoding a 0.7 MB schema body holds the front's GIL for 10-40 ms in single calls that cannot
be interrupted (`pydantic_core.from_json` 9 ms, the objects it makes, their validation), and
the schema's budget walk then runs in the same process: on the GIL that also serves every
plain completion. What the clients that send such bodies mostly send is refused by the
validation budget (structured_output.budget: 12,000 properties, 450 optional ones), so a body
over OFF_LOOP_BODY_BYTES is first read in a child process (one, spawned once) that decodes it
and measures its constraints (`structured_outputs.json`, `response_format`'s schema, the
tools' parameters): one over the budget is a 400 at once, and the front never decodes it. The
front only copies the bytes to the child (the pipe write drops the GIL). A body the child
passes, or cannot read, is decoded by the front as before (its own verdict, its messages). At
most MAX_WAITING bodies wait for the child, each at most PRECHECK_TIMEOUT_S; past either the
front goes on without the child's verdict (the budget is checked again on the grammar-check
threads either way).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import multiprocessing
import os
import threading
from typing import Any

import pydantic_core

from slotserve.entrypoints.openai.errors import bad_request
from slotserve.errors import RequestValidationError
from slotserve.structured_output.budget import check_schema_budget
from slotserve.structured_output.compile_queue import NICE_INCREMENT

PRECHECK_TIMEOUT_S = 5.0
MAX_WAITING = 8

_pool: concurrent.futures.ProcessPoolExecutor | None = None
_waiting = 0
_lock = threading.Lock()


def constraint_schemas(data: Any) -> list[tuple[dict[str, Any], str]]:
    """(schema, the field the client sent) of each JSON schema in a request body."""
    if not isinstance(data, dict):
        return []
    out: list[tuple[dict[str, Any], str]] = []
    so = data.get("structured_outputs")
    if isinstance(so, dict) and isinstance(so.get("json"), dict):
        out.append((so["json"], "structured_outputs.json"))
    rf = data.get("response_format")
    spec = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        out.append((spec["schema"], "response_format"))
    tools = data.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if isinstance(params, dict):
            out.append((params, "tools"))
    return out


def precheck(body: bytes) -> tuple[str, str] | None:
    """(message, field) of the first constraint over the budget; None when there is none or
    the body does not decode (the front's own decode gives that verdict). Runs in the child."""
    try:
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError:
        return None
    for schema, param in constraint_schemas(data):
        try:
            check_schema_budget(schema, param)
        except RequestValidationError as exc:
            return exc.message, param
    return None


def _lower_priority() -> None:
    # As the grammar-check threads: on a machine with no spare core the child yields to the
    # front, the step loop and the forward pass (a large body then waits a little longer).
    with contextlib.suppress(OSError):
        os.nice(NICE_INCREMENT)


def start() -> concurrent.futures.ProcessPoolExecutor:
    """The child (spawned, not forked: the front runs threads), started once."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_lower_priority)
            # Before the interpreter tears its modules down (the pool's thread needs them).
            atexit.register(shutdown, True)
            # The pool spawns its child at the first submit: now, at start-up, not when the
            # first large body arrives (the child's imports take a CPU second).
            _pool.submit(precheck, b"{}")
        return _pool


def shutdown(wait: bool = False) -> None:
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=wait, cancel_futures=True)


async def refuse_over_budget(body: bytes) -> None:
    """A 400 (APIError) naming the field when the child finds a constraint of `body` over
    the validation budget; otherwise nothing (also when the child is busy or too slow)."""
    global _waiting
    with _lock:
        if _waiting >= MAX_WAITING:
            return
        _waiting += 1
    try:
        future = start().submit(precheck, body)
        verdict = await asyncio.wait_for(asyncio.wrap_future(future), PRECHECK_TIMEOUT_S)
    except TimeoutError:
        return
    except (concurrent.futures.process.BrokenProcessPool, RuntimeError):
        shutdown()  # a new child next time
        return
    finally:
        with _lock:
            _waiting -= 1
    if verdict is not None:
        raise bad_request(verdict[0], verdict[1])
