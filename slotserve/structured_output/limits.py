"""What one grammar may cost, and what of its failure leaves the engine.

A grammar is untrusted input. llguidance bounds its own work with `LLParserLimits`; the
defaults let one 150-byte schema (`^((a{100}){100}){3}$`) build hundreds of MB of lexer
states, and its error messages carry the parser state and the generated grammar (900 KB for a
large regex). Here: tighter limits, applied the same in the front's validation and the core's
compile; error messages without state dumps or backtraces, cut to a bounded excerpt; and the
engine log of grammar failures rate-limited.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a grammar is checked: the front reads the limits first
    import llguidance

# The lexer's states are its memory (1-2 kB each, against llguidance's default of 250,000);
# JSON schemas of real APIs need a few thousand.
MAX_LEXER_STATES = 50_000
# Earley items per mask step: the parser's work per token (llguidance's default, 50,000, is
# about 2.5 ms); a grammar that needs more at its first token is refused at compile.
STEP_MAX_ITEMS = 50_000
# Symbols in the grammar's productions (llguidance's default 500,000).
MAX_GRAMMAR_SIZE = 200_000
# Characters of a library message kept in an error body or a log line.
MAX_ERROR_CHARS = 300
_TRUNCATED = " ... (truncated)"
# What cuts a message short: a Rust panic's backtrace, a verbose state dump.
_CUT_MARKERS = ("\nstack backtrace", "\nnote: run with", "<non-verbose/>", "\n<state>",
                "\nGrammar:", "\ngrammar:")


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every compile and validation uses (never verbose: a verbose error includes
    the parser state and the grammar)."""
    import llguidance

    return llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES,
                                     step_max_items=STEP_MAX_ITEMS,
                                     max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)


def error_excerpt(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The library's message fit for a client or a log line: no backtrace or state dump, at
    most `limit` characters on one line."""
    for marker in _CUT_MARKERS:
        message = message.split(marker, 1)[0]
    message = " ".join(message.split())
    if len(message) > limit:
        message = message[:limit - len(_TRUNCATED)].rstrip() + _TRUNCATED
    return message or "the grammar library gave no reason"


class RateLimitedLog:
    """At most `burst` lines per `period_s` seconds; the next line allowed says how many were
    dropped. One hostile client's failing grammars must not fill the engine's log."""

    def __init__(self, logger: logging.Logger, burst: int = 5, period_s: float = 10.0) -> None:
        self.logger, self.burst, self.period_s = logger, burst, period_s
        self._window_start = float("-inf")
        self._count = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def warning(self, fmt: str, *args: object) -> bool:
        """Log (True) or drop (False) one line."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self.period_s:
                self._window_start, self._count = now, 0
            if self._count >= self.burst:
                self._dropped += 1
                return False
            self._count += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            fmt += f" ({dropped} similar lines dropped)"
        self.logger.warning(fmt, *args)
        return True
