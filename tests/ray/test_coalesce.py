"""How a replica batches an HTTP answer's ASGI messages for the Ray path (no cluster): the
start rides with the first body, the first body goes at once, then every `stream_interval`
bodies and the last; what the app had already sent goes in one message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from slotserve.ray.server import coalesced, drive_asgi, merge_bodies  # noqa: E402

START = {"type": "http.response.start", "status": 200, "headers": []}


def body(text: str, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": text.encode(), "more_body": more}


async def _batches(*batches: list[dict[str, Any]]) -> AsyncIterator[list[dict[str, Any]]]:
    for b in batches:
        yield b


def _collect(interval: int, *batches: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    async def go() -> list[list[dict[str, Any]]]:
        return [b async for b in coalesced(_batches(*batches), interval)]
    return asyncio.run(go())


def test_merge_bodies_joins_consecutive_bodies_only() -> None:
    merged = merge_bodies([START, body("a"), body("b"), body("c", more=False)])
    assert merged == [START, body("abc", more=False)]
    assert merge_bodies([body("x")]) == [body("x")]


def test_every_token_alone_at_interval_one() -> None:
    out = _collect(1, [START], [body("1")], [body("2")], [body("3", more=False)])
    assert out == [[START, body("1")], [body("2")], [body("3", more=False)]]


def test_interval_batches_after_the_first_and_flushes_the_last() -> None:
    tokens = [[body(str(i))] for i in range(6)]
    out = _collect(3, [START], *tokens, [body("end", more=False)])
    assert out == [[START, body("0")], [body("123")], [body("45end", more=False)]]
    # Nothing is lost or reordered whatever the interval.
    for interval in (1, 2, 5, 100):
        got = _collect(interval, [START], *tokens, [body("end", more=False)])
        assert b"".join(m["body"] for b in got for m in b if "body" in m) == b"012345end"


def test_a_whole_answer_the_app_sent_at_once_is_one_message() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(START)
        await send(body('{"ok"'))
        await send(body(": 1}", more=False))

    async def go() -> list[list[dict[str, Any]]]:
        inbound: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        batches = drive_asgi(app, {"type": "http"}, inbound, {"type": "http.disconnect"})
        return [b async for b in coalesced(batches, 1)]

    assert asyncio.run(go()) == [[START, body('{"ok": 1}', more=False)]]
