"""A logical clock for streaming sessions in checks (exploration, fuzzing, trace replay).

Sessions read `time.monotonic()` for idle timeouts. Inside `logical_time()` that read returns
`CLOCK.now` instead, which only the caller moves, so a timeout happens at a chosen event and a
recorded trace reproduces it. When the scheduler takes time as an argument (`now`), callers
pass the value instead and this module goes away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import slotserve.core.sessions as _sessions


class LogicalClock:
    """Stands in for the `time` module inside slotserve.core.sessions."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


CLOCK = LogicalClock()


@contextlib.contextmanager
def logical_time(start: float = 0.0) -> Iterator[LogicalClock]:
    saved = _sessions.time
    CLOCK.now = start
    _sessions.time = CLOCK  # type: ignore[assignment]
    try:
        yield CLOCK
    finally:
        _sessions.time = saved
