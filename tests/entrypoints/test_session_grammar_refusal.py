"""A WebSocket session whose grammar the engine refuses for its masks' cost (the mask-time
budget of structured_output.manager) ends visibly: a fatal error message naming the cause
(code grammar_too_expensive, param structured_outputs), then the socket closes with 1011 and
a reason, not a session.done as if the session had ended well, nor a silent drop. Nothing is
left held, in both engine modes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.entrypoints.conftest import Served
from tests.entrypoints.test_sessions import ws_url

GRAMMAR = {"structured_outputs": {"grammar": 'start: s\ns: s s | "a" | "b"'}}


@pytest.fixture()
def over_budget(any_mode: Served) -> Iterator[Served]:
    previous = any_mode.call_utility("set_mask_budget", 1e-9)
    try:
        yield any_mode
    finally:
        any_mode.call_utility("set_mask_budget", previous)


def test_a_session_refused_for_its_masks_closes_with_1011(over_budget: Served) -> None:
    messages: list[dict[str, Any]] = []
    with connect(ws_url(over_budget.url), open_timeout=30) as ws:
        assert json.loads(ws.recv(30))["type"] == "session.created"
        ws.send(json.dumps({"type": "input", "prompt": "To be", "max_tokens": 16,
                            "ignore_eos": True, **GRAMMAR}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(ws.recv(60)))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011, closed.value
    assert "too costly" in closed.value.rcvd.reason, closed.value.rcvd
    (error,) = [m for m in messages if m["type"] == "error"]
    assert error["fatal"] is True, error
    assert error["error"]["code"] == "grammar_too_expensive", error
    assert error["error"]["param"] == "structured_outputs", error
    assert not [m for m in messages if m["type"] in ("session.done", "chunk.done")], messages
    assert {m["type"] for m in messages} <= {"delta", "error"}, messages
