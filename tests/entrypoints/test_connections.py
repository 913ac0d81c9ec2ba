"""Connections that are idle, half-sent, too many or too big (issue 11, items 4 and 5): each is
timed out or refused cleanly, with a bounded number of log lines, and the server keeps
answering. A server on the shared engine, behind uvicorn as `slotserve serve` configures it,
with short deadlines so the test stays quick."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from slotserve.entrypoints.log_limits import RepeatFilter
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.limits import ServerLimits
from tests.entrypoints.conftest import MODEL_NAME, Served, start_server

LIMITS = ServerLimits(timeout_keep_alive_s=0.5, timeout_request_read_s=0.5, max_connections=8,
                      max_ws_message_bytes=4096)


def _front(served: Served, limits: ServerLimits) -> Iterator[str]:
    """A server with these limits in front of the shared engine."""
    app = build_app(served.engine, served_model_names=[MODEL_NAME], limits=limits,
                    shutdown_engine=False)
    server = start_server(served.loop, app)
    try:
        yield server.base_url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def guarded(served: Served) -> Iterator[str]:
    yield from _front(served, LIMITS)


# For the connection cap: idle sockets must stay open through the test on a loaded machine
# (with LIMITS' 0.5 s they were closed before the capped request; seen at load 13).
CAP_LIMITS = ServerLimits(timeout_keep_alive_s=30, timeout_request_read_s=30, max_connections=8)


@pytest.fixture(scope="module")
def capped(served: Served) -> Iterator[str]:
    yield from _front(served, CAP_LIMITS)


def _sock(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _wait_health(url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_connection_that_sends_nothing_is_closed(guarded: str) -> None:
    with _sock(guarded) as s:
        start = time.monotonic()
        assert _read_all(s) == b""
        assert 0.4 < time.monotonic() - start < 5


def test_headers_sent_a_byte_at_a_time_get_408(guarded: str) -> None:
    with _sock(guarded) as s:
        start = time.monotonic()
        s.settimeout(0.3)
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        reply = b""
        for b in request:  # 70 bytes at 0.1 s each would take 7 s
            try:
                s.sendall(bytes([b]))
                reply = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if reply:
                break
        s.settimeout(10)
        reply += _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5


def test_a_slow_body_gets_408(guarded: str) -> None:
    with _sock(guarded) as s:
        start = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"request_timeout" in reply and time.monotonic() - start < 5
    _wait_health(guarded)


def test_connection_cap_gives_503_and_frees_up(capped: str) -> None:
    idle = [_sock(capped) for _ in range(CAP_LIMITS.max_connections)]
    try:
        r = httpx.get(f"{capped}/v1/models")
        assert r.status_code == 503
        with pytest.raises(InvalidStatus) as e:
            connect(capped.replace("http", "ws") + "/v1/sessions", open_timeout=10)
        assert e.value.response.status_code == 503
        # Past twice the cap a connection is closed unread at once, not after the 30 s read
        # timeout (measured: 0.01 s at load 11; 2 s is the margin for a loaded machine).
        flood = [_sock(capped) for _ in range(CAP_LIMITS.max_connections + 2)]
        start = time.monotonic()
        assert _read_all(flood[-1]) == b"" and time.monotonic() - start < 2.0
        for s in flood:
            s.close()
    finally:
        for s in idle:
            s.close()
    _wait_health(capped)
    assert httpx.get(f"{capped}/v1/models").status_code == 200


def test_oversized_websocket_message_closes_with_1009(guarded: str) -> None:
    with connect(guarded.replace("http", "ws") + "/v1/sessions", open_timeout=10,
                 max_size=None) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        ws.send(json.dumps({"type": "input", "prompt": "x" * 10_000}))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009
    _wait_health(guarded)


def test_repeated_log_lines_are_rate_limited() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    flt = RepeatFilter(burst=5, window_s=0.2)
    handler.addFilter(flt)
    log = logging.getLogger("test.flood")
    log.addHandler(handler)
    log.propagate = False
    try:
        for i in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.error("socket.accept() out of system resource\nsocket: %r", i,
                          exc_info=True)
        log.warning("a different line")
        assert len(records) == 6 and flt.num_dropped == 995
        time.sleep(0.25)
        log.error("socket.accept() out of system resource\nsocket: %r", 0)
        assert "995 more like this were dropped" in records[-1].getMessage()
    finally:
        log.removeHandler(handler)
