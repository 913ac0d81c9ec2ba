"""The server's limits on what clients can hold (issue 11), and the uvicorn configuration that
applies them. Each is a `slotserve serve` flag; README "Limits" lists them with their defaults.

Connection-level limits are uvicorn's own options where it has one (`timeout_keep_alive`,
`limit_concurrency`, `ws_max_size`, its header size limit), plus what `http_protocol` adds
(deadlines for connections that send nothing or send slowly). Request-level limits (body
size, body read time) are checked by the app; admission limits (waiting sequences and
tokens, the per-client share) by `admission.AdmissionController`.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn

from slotserve.entrypoints.openai.http_protocol import GuardedH11Protocol
from slotserve.errors import ConfigError

MIB = 1024 * 1024
# The request body cap when none is given: room for any body the admission could accept, that
# is 8 bytes for each token one client may have waiting (a token id in a JSON list takes at
# most 8 for a vocabulary under a million; text takes fewer per token) plus 1 MiB for
# everything else (messages' structure, tools, schemas), and never more than 8 MiB (the fixed
# cap before; a server that admits more, e.g. 256 slots of 8k tokens, keeps it). Why not only
# a fixed size: the front reads and decodes a body whole, holding the GIL, before it can
# refuse it for its length in tokens. In the chaos run (benchmarks/chaos.py, the bundled
# model) three 7 MB bodies every 3 s held the front's event loop: a first token that the
# engine had produced waited up to 195 ms to be sent (p99 115 ms); refused from their
# Content-Length, p99 21-31 ms.
BODY_BASE_BYTES = 1 * MIB
BODY_BYTES_PER_TOKEN = 8
# The ceiling, and the cap where no engine is known to derive it from (the Ray ingress: its
# replicas check their own).
FALLBACK_MAX_BODY_BYTES = 8 * MIB


def default_max_body_bytes(client_max_tokens: int) -> int:
    """The body cap for a server where one client may have `client_max_tokens` waiting."""
    return min(FALLBACK_MAX_BODY_BYTES,
               BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * client_max_tokens)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    # A request body over this is refused with 413 (as soon as that is known). None: derived
    # from the admission bounds (default_max_body_bytes) by the app that has an engine.
    max_body_bytes: int | None = None
    # A WebSocket message over this closes the session with 1009 (message too big).
    max_ws_message_bytes: int = 1 * MIB
    # A connection idle this long (before its first request or between requests) is closed.
    timeout_keep_alive_s: float = 5.0
    # A request's headers, and then its body, must arrive within this (else 408).
    timeout_request_read_s: float = 30.0
    # Open connections (HTTP and WebSocket); past it new requests get 503.
    max_connections: int = 1000
    # Admission: sequences accepted but not yet producing tokens, and their tokens (prompt +
    # max_tokens); past either a request gets 429 with Retry-After. None: derived from the
    # engine (admission.default_bounds).
    max_waiting_seqs: int | None = None
    max_waiting_tokens: int | None = None
    # One client (its `user` field, else its address) holds at most this share of either.
    max_client_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_ws_message_bytes", "max_connections"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("timeout_keep_alive_s", "timeout_request_read_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds")
        for name in ("max_waiting_seqs", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not 0.0 < self.max_client_share <= 1.0:
            raise ConfigError("max_client_share must be in (0, 1]")

    @property
    def body_limit(self) -> int:
        """max_body_bytes, or FALLBACK_MAX_BODY_BYTES where it was left to be derived."""
        return FALLBACK_MAX_BODY_BYTES if self.max_body_bytes is None else self.max_body_bytes


def file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config that applies the limits; `kwargs` go to uvicorn (host, port, ...).

    The connection cap is lowered to what the process's file limit leaves room for (with 64
    descriptors for the engine, the model and logs), so descriptors never run out first."""
    cap = max(1, min(limits.max_connections, file_limit() // 2 - 64))
    protocol = GuardedH11Protocol.with_limits(limits.timeout_request_read_s, cap)
    return uvicorn.Config(
        app, http=protocol, limit_concurrency=cap,
        timeout_keep_alive=limits.timeout_keep_alive_s,  # type: ignore[arg-type]
        ws_max_size=limits.max_ws_message_bytes, **kwargs)
