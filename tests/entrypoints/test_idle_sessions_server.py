"""Idle WebSocket sessions cannot lock a server's slots (issue 11, item 2): with every slot held
by an idle session, a new request waits only for the grace period, takes the slot of the
longest-idle session, and that session recomputes on its next chunk; a session left idle is
ended after the idle timeout and told why, as is a socket that never sends a first chunk."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import LoopThread, scrape, start_server

GRACE_S, TIMEOUT_S = 0.5, 2.0


@pytest.fixture(scope="module")
def two_slots(loop_thread: LoopThread) -> Iterator[str]:
    engine = AsyncLLM.from_engine_args(
        max_num_seqs=2, num_blocks=64, max_model_len=256, device="cpu", dtype="float32",
        check=True, idle_slot_grace_s=GRACE_S, streaming_session_timeout_s=TIMEOUT_S,
        max_idle_sessions=2,  # (the default, half the slots, would take one at once)
        engine_mode="thread", threads=1)
    server = start_server(loop_thread, build_app(engine, served_model_names=["m"],
                                                 shutdown_engine=False))
    try:
        yield server.base_url
    finally:
        server.stop()
        engine.shutdown()


def _recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=30))


def _chunk(ws: ClientConnection, prompt: str) -> dict[str, Any]:
    ws.send(json.dumps({"type": "input", "prompt": prompt, "max_tokens": 3,
                        "ignore_eos": True, "temperature": 0}))
    while (msg := _recv(ws))["type"] != "chunk.done":
        assert msg["type"] == "delta", msg
    return msg


def _ws(url: str) -> ClientConnection:
    return connect(url.replace("http", "ws") + "/v1/sessions", open_timeout=30)


def test_idle_sessions_give_up_their_slots_after_the_grace_period(two_slots: str) -> None:
    with _ws(two_slots) as a, _ws(two_slots) as b:
        _recv(a), _recv(b)
        _chunk(a, "Now is the winter")
        a_idle = time.monotonic()  # a went idle just before its chunk.done reached us
        time.sleep(0.1)
        _chunk(b, "of our discontent")
        assert scrape(two_slots)["slotserve:num_slots_held"] == 2  # both idle, both held
        start = time.monotonic()
        r = httpx.post(f"{two_slots}/v1/completions", timeout=30, json={
            "prompt": "Made glorious summer", "max_tokens": 4, "ignore_eos": True})
        done = time.monotonic()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # Not before a's grace period ran out (less the 0.2 s chunk.done may take to reach us),
        # and not long after it (the margin is for a loaded machine).
        assert done - a_idle >= GRACE_S - 0.2, done - a_idle
        assert done - start < GRACE_S + 5
        metrics = scrape(two_slots)
        assert metrics["slotserve:idle_session_slots_reclaimed_total"] == 1
        # a, the longest idle, lost its slot; it still holds its tokens and goes on.
        done = _chunk(a, " by this sun of York")
        assert done["usage"]["completion_tokens"] == 3
        for ws in (a, b):
            ws.send(json.dumps({"type": "end"}))
            assert _recv(ws)["reason"] == "end"
    deadline = time.monotonic() + 10
    while scrape(two_slots)["slotserve:num_slots_held"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(two_slots)["slotserve:num_slots_held"] == 0


def test_idle_sessions_are_ended_and_told_why(two_slots: str) -> None:
    results: dict[str, dict[str, Any]] = {}

    def silent() -> None:  # never sends a chunk
        with _ws(two_slots) as ws:
            _recv(ws)
            results["silent"] = _recv(ws)

    thread = threading.Thread(target=silent)
    thread.start()
    with _ws(two_slots) as ws:
        _recv(ws)
        _chunk(ws, "Once more unto the breach")
        start = time.monotonic()
        done = _recv(ws)  # then nothing: the engine ends the idle session
        waited = time.monotonic() - start
    thread.join(30)
    assert done["type"] == "session.done" and done["reason"] == "idle_timeout", done
    assert "idle" in done["message"] and TIMEOUT_S - 0.2 <= waited < TIMEOUT_S + 3
    assert done["usage"]["completion_tokens"] == 3
    assert results["silent"]["type"] == "session.done"
    assert results["silent"]["reason"] == "idle_timeout"
