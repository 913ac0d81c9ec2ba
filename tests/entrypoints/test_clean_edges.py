"""Clean edges (issue 11, items 7-9): binary frames, floods and disconnects get a proper error
or close and at most one quiet log line; empty keys are refused at startup; admin endpoints are
off unless enabled and need their key; error responses carry no internal text; a session
takes no input after its end, and an empty first chunk is refused as an empty prompt is."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from slotserve.entrypoints.openai.api_server import build_app
from slotserve.errors import ConfigError
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, Served, start_server


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def server_log() -> Iterator[_Records]:
    """Every record of the server's loggers (uvicorn's do not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("slotserve").setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        logging.getLogger("slotserve").setLevel(logging.NOTSET)


def _loud(log: _Records) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in log.records if r.levelno >= logging.INFO]


@contextlib.contextmanager
def _ws(served: Served) -> Iterator[ClientConnection]:
    with connect(served.url.replace("http", "ws") + "/v1/sessions", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        yield ws


def _recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=30))


def _chunk(ws: ClientConnection, prompt: Any, max_tokens: int = 2) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "input", "prompt": prompt, "max_tokens": max_tokens,
                        "ignore_eos": True, "temperature": 0}))
    msgs = [_recv(ws)]
    while msgs[-1]["type"] not in ("chunk.done", "error"):
        msgs.append(_recv(ws))
    return msgs


# --------------------------------------------------------------------------- item 7
def test_binary_frame_gets_an_error_and_the_session_goes_on(drained: Served,
                                                            server_log: _Records) -> None:
    with _ws(drained) as ws:
        ws.send(b"\x00\x01binary")
        err = _recv(ws)
        assert err["type"] == "error" and not err["fatal"]
        assert err["error"]["code"] == "unsupported_frame"
        assert _chunk(ws, "To be")[-1]["type"] == "chunk.done"
        ws.send(json.dumps({"type": "end"}))
        assert _recv(ws)["type"] == "session.done"
    assert not _loud(server_log)


def test_flooded_session_then_closed_is_quiet(drained: Served, server_log: _Records) -> None:
    # The client floods without reading a reply, then leaves (not waiting for the server's
    # close frame, which sits behind the replies it never reads).
    url = drained.url.replace("http", "ws") + "/v1/sessions"
    with connect(url, open_timeout=30, close_timeout=0.5) as ws:
        ws.recv(timeout=30)
        for i in range(1000):
            ws.send(json.dumps({"type": "input", "prompt": [1, 300 + i % 50], "max_tokens": 1}))
    # Chunks past the waiting room are refused, not queued, and a reply the client does not
    # take drops it: the server sees it leave at once (not after running 1000 chunks for a
    # client that has gone) and holds nothing.
    start = time.monotonic()
    state = drained.wait_drained()
    assert not state["requests"] and not state["worker_slots"], state
    assert time.monotonic() - start < 5
    loud = _loud(server_log)
    assert not loud, loud
    assert len([r for r in server_log.records if "session" in r.getMessage()]) <= 1


def test_client_leaving_mid_upload_is_quiet(drained: Served, server_log: _Records) -> None:
    host, port = drained.url.removeprefix("http://").split(":")
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"")
            s.sendall(b"x" * 20_000)
    time.sleep(0.5)
    assert httpx.get(f"{drained.url}/health").status_code == 200
    loud = _loud(server_log)
    assert not loud, loud
    assert sum("client went away" in r.getMessage() for r in server_log.records) <= 5


# --------------------------------------------------------------------------- item 8
def test_an_empty_key_is_refused_by_the_app() -> None:
    # The CLI's refusals at startup, in a subprocess: test_serve_process.py.
    with pytest.raises(ConfigError):
        build_app(None, served_model_names=["m"], api_key="")  # type: ignore[arg-type]


def test_admin_endpoints_need_enabling_and_their_key(served: Served) -> None:
    url = "/reset_prefix_cache?reset_running_requests=false"
    assert httpx.post(served.url + url).status_code == 404  # not enabled
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(served.key_url + url, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    admin = build_app(served.engine, served_model_names=[MODEL_NAME], api_key=API_KEY,
                      enable_admin=True, admin_api_key="admin-only", shutdown_engine=False)
    server = start_server(served.loop, admin)
    try:
        assert httpx.post(server.base_url + url,
                          headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        r = httpx.post(server.base_url + url, headers={"Authorization": "Bearer admin-only"})
        assert r.status_code == 200 and r.json() == {"success": True}
        r = httpx.post(server.base_url + url.replace("false", "maybe"),
                       headers={"Authorization": "Bearer admin-only"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reset_running_requests"
        # The admin key is not a key for the rest.
        assert httpx.get(server.base_url + "/v1/models",
                         headers={"Authorization": "Bearer admin-only"}).status_code == 401
    finally:
        server.stop()


def test_an_unexpected_error_shows_no_internals(drained: Served, server_log: _Records,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken() -> Any:
        raise KeyError("/srv/slotserve/secret_module.py: internal detail")

    monkeypatch.setattr(drained.engine, "get_stats", broken)
    r = httpx.get(f"{drained.url}/metrics")
    assert r.status_code == 500
    body = r.json()["error"]
    assert body["code"] == "internal_error" and "error id" in body["message"]
    assert "secret" not in r.text and "KeyError" not in r.text and ".py" not in r.text
    error_id = body["message"].split("error id ")[1].rstrip(")")
    logged = [rec.getMessage() for rec in server_log.records]
    assert any(error_id in m and "secret_module" in m for m in logged)


# --------------------------------------------------------------------------- item 9
def test_input_after_end_is_refused_explicitly(drained: Served) -> None:
    with _ws(drained) as ws:
        ws.send(json.dumps({"type": "input", "prompt": "Now is the winter", "max_tokens": 40,
                            "ignore_eos": True}))
        ws.send(json.dumps({"type": "end"}))
        ws.send(json.dumps({"type": "input", "prompt": "too late", "max_tokens": 2}))
        ws.send(json.dumps({"type": "end"}))
        msgs = [_recv(ws)]
        while msgs[-1]["type"] != "session.done":
            msgs.append(_recv(ws))
    errors = [m for m in msgs if m["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["session_ended", "session_ended"]
    assert not any(e["fatal"] for e in errors)
    assert sum(m["type"] == "chunk.done" for m in msgs) == 1
    assert msgs[-1]["reason"] == "end"


@pytest.mark.parametrize("empty", ["", []])
def test_empty_first_chunk_is_refused_as_an_empty_prompt_is(drained: Served,
                                                            empty: Any) -> None:
    http = httpx.post(f"{drained.url}/v1/completions",
                      json={"model": MODEL_NAME, "prompt": empty, "max_tokens": 2})
    assert http.status_code == 400 and http.json()["error"]["param"] == "prompt"
    with _ws(drained) as ws:
        err = _chunk(ws, empty)[-1]
        assert err["type"] == "error" and not err["fatal"]
        assert err["error"]["param"] == "prompt" and "empty" in err["error"]["message"]
        # A later chunk may be empty: it continues generating from the session's tokens.
        assert _chunk(ws, "To be")[-1]["type"] == "chunk.done"
        done = _chunk(ws, empty, max_tokens=3)
        assert done[-1]["type"] == "chunk.done" and done[-1]["usage"]["completion_tokens"] == 3
        ws.send(json.dumps({"type": "end"}))
        assert _recv(ws)["type"] == "session.done"
