"""uvicorn's h11 protocol with the two deadlines it lacks, and a hard connection ceiling.

uvicorn times out a keep-alive connection only after a response; a connection that never
sends anything, or sends its request headers a byte at a time, stays open forever (20,000 such
sockets exhausted the file limit, issue 11). Its own options do the rest and are used as they
are: `timeout_keep_alive` (idle between requests), `limit_concurrency` (a 503 once that many
connections or requests are open), `h11_max_incomplete_event_size` (header size), `ws_max_size`
(WebSocket messages). This subclass adds:

- the keep-alive timer armed when a connection opens, so one that sends nothing is closed
  after `timeout_keep_alive` like an idle keep-alive connection;
- a read deadline from a request's first byte to its complete headers (a slow-header client
  gets a 408 and is closed); the body's deadline is the app's (api_server.read_body);
- the concurrency limit applied to WebSocket upgrades too (uvicorn upgrades before it looks);
- past twice the limit a new connection is closed at once, unread, so a flood cannot hold
  file descriptors even for the keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from slotserve.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    # Set per server by `with_limits` (uvicorn builds the protocol from its class).
    read_timeout_s: float = 30.0
    max_connections: int | None = None

    @classmethod
    def with_limits(cls, read_timeout_s: float,
                    max_connections: int | None) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"read_timeout_s": read_timeout_s,
                                                   "max_connections": max_connections})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.max_connections
        if cap is not None and len(self.connections) > 2 * cap:
            logger.warning("connection flood: %d open connections, over twice the limit of "
                           "%d; closing new ones unread", len(self.connections), cap)
            self.connections.discard(self)
            transport.abort()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Partial headers: h11 has buffered bytes but still waits for the request line and
        # headers to end.
        if (self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]
                and not self.transport.is_closing()):
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(self.read_timeout_s,
                                                           self._headers_timed_out)
        else:
            self._cancel_read_deadline()

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _headers_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.info("closing a connection whose request headers did not arrive within %g s",
                    self.read_timeout_s)
        self.transport.write(_raw_response(
            408, "Request Timeout", f"the request headers did not arrive within "
            f"{self.read_timeout_s:g} s", "request_timeout"))
        self.transport.close()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel_read_deadline()
        cap = self.limit_concurrency
        if cap is not None and len(self.connections) >= cap:
            logger.warning("Exceeded concurrency limit.")
            self.transport.write(_raw_response(
                503, "Service Unavailable", "the server is at its connection limit; retry "
                "later", "too_many_connections"))
            self.transport.close()
            return
        super().handle_websocket_upgrade(event)
