"""Rate-limited logging: a flood of one kind of line (asyncio's `socket.accept() out of system
resource` with its traceback, uvicorn's `Exceeded concurrency limit.`) must not become a flood
of log (233,000 tracebacks, 111 MB in 25 s, issue 11).

`RepeatFilter` lets through at most `burst` records of one kind (logger, level and message
template: the text before its arguments are filled in) per `window_s`; the first record of
the next window says how many were dropped. Access logs are left alone (every line differs).
"""

from __future__ import annotations

import logging
import threading
import time

# Loggers whose handlers get the filter (the root's handlers serve asyncio and slotserve).
FILTERED_LOGGERS = ("", "uvicorn", "uvicorn.error")
_MAX_KINDS = 4096


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = 5, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        # kind -> [window start, records seen in it, records dropped in the previous one]
        self._kinds: dict[tuple[str, int, str], list[float]] = {}
        self._lock = threading.Lock()
        self.num_dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            state = self._kinds.get(kind)
            if state is None or now - state[0] >= self.window_s:
                dropped = 0 if state is None else max(0, int(state[1]) - self.burst)
                if len(self._kinds) >= _MAX_KINDS:
                    self._kinds.clear()
                state = self._kinds[kind] = [now, 0.0, float(dropped)]
            state[1] += 1
            if state[1] > self.burst:
                self.num_dropped += 1
                return False
            if state[1] == 1 and state[2]:
                record.msg = (f"{record.msg} [{int(state[2])} more like this were dropped in "
                              f"the previous {self.window_s:g} s]")
            return True


def install(burst: int = 5, window_s: float = 10.0) -> RepeatFilter:
    """Put one RepeatFilter on the handlers of the root logger and uvicorn's error logger
    (call after logging and uvicorn's logging are configured)."""
    flt = RepeatFilter(burst, window_s)
    for name in FILTERED_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatFilter) for f in handler.filters):
                handler.addFilter(flt)
    return flt
