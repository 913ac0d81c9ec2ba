"""vLLM's `stream_interval` (`--stream-interval N`): a stream's SSE events go on in batches of
N after the first, since each write costs the server (and on the Ray path a Ray message, the
ingress's relay and the proxy's) more than its bytes do. The first goes at once (the time to
first token), the last is never held back, and N = 1 sends each at once.

One rule for both servers: the one-process app batches its SSE writes with it
(OpenAIServing.sse_frames), a Ray replica its ASGI body messages (ray.server.coalesced)."""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.errors import ConfigError


def check_stream_interval(value: object) -> int:
    """`value` when it is a valid interval (an integer of at least 1), else ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"stream_interval (--stream-interval) must be an integer of at least "
                          f"1 (1: each SSE event at once), got {value!r}")
    return value


@dataclass(slots=True)
class StreamInterval:
    """When what a stream holds goes on: feed it each new piece (`due`), send what is held
    when it says so."""

    interval: int = 1
    # Events held since the last send, and whether anything has been sent yet.
    held: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        check_stream_interval(self.interval)

    def due(self, events: int, last: bool = False) -> bool:
        """`events` more are held (`last`: nothing follows them); True when everything held
        goes now: the first, then every `interval`, and the last. The count starts again."""
        self.held += events
        if not self.held or (self.started and self.held < self.interval and not last):
            return False
        self.held, self.started = 0, True
        return True
