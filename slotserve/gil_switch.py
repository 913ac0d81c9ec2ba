"""How long a Python thread may hold the GIL before another thread that wants it gets it.

CPython's default is 5 ms. In the server process the event loop shares the GIL with the
threads that tokenize, validate schemas and compile grammars; in the engine core process the
step loop shares it with the pipe's reader and sender threads. A thread doing pure-Python work
(a large JSON schema, a detokenization) keeps the GIL for the whole interval every time it is
handed over, so every other thread waits up to 5 ms per handover, and a request's tail latency
grows by that much per step. Measured (benchmarks/grammar_isolation.py --parts front, same-run
A/B against CPython's 5 ms): a plain completion's p99 beside four 0.9 MB
schemas 2.17x -> 1.70x of the clean run under load 0.6-1.8, no difference on an idle machine
(3.14x / 2.96x). The cost is more handovers, which only matter while threads contend.
"""

from __future__ import annotations

import os
import sys

from slotserve.errors import ConfigError

SWITCH_INTERVAL_S = 0.0005
# Seconds; CPython's own 0.005 restores the default (benchmarks' A/B runs use it).
SWITCH_INTERVAL_ENV = "SLOTSERVE_SWITCH_INTERVAL"


def configured_interval() -> float:
    raw = os.environ.get(SWITCH_INTERVAL_ENV)
    if raw is None:
        return SWITCH_INTERVAL_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 1:
        raise ConfigError(f"{SWITCH_INTERVAL_ENV}={raw!r}: expected seconds in (0, 1], "
                          "e.g. 0.0005")
    return seconds


def shorten_switch_interval(seconds: float | None = None) -> float:
    """Set the interpreter's switch interval to `seconds` (default: $SLOTSERVE_SWITCH_INTERVAL,
    else 0.5 ms) if that is shorter; returns the interval in force before (a caller that set a
    shorter one keeps it)."""
    target = configured_interval() if seconds is None else seconds
    previous = sys.getswitchinterval()
    if target < previous:
        sys.setswitchinterval(target)
    return previous
