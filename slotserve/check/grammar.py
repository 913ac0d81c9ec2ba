"""Grammars for the checks, free of any grammar library: they implement the scheduler's
StructuredOutputGrammar protocol, so the fuzzer, the explorer and trace replays drive the
scheduler's grammar bookkeeping (advance with kept tokens, stop on completion, fail, roll
back at a session's fold) and the checker compares what each consumed.

- `CountingGrammar(length)`: accepts any token but `REJECTED`, complete after `length`.
- `ReplayGrammar`: accepts anything; a trace replay tells it when the recorded run's grammar
  compiled, completed or failed (TraceRecorder records those outcomes per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A token the counting grammar refuses (a grammar library failing mid-output).
REJECTED = 9


@dataclass(slots=True)
class _CheckGrammar:
    """What both grammars share: the tokens consumed, a failure, always compiled."""
    consumed: list[int] = field(default_factory=list, kw_only=True)
    failure: str | None = field(default=None, kw_only=True)

    def rollback(self, num_tokens: int) -> None:
        del self.consumed[len(self.consumed) - num_tokens:]

    def is_ready(self) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        return tokens.index(REJECTED) if REJECTED in tokens else len(tokens)

    @property
    def error(self) -> str | None:
        return self.failure

    @property
    def refusal(self) -> str | None:
        return None

    @property
    def consumed_token_ids(self) -> list[int]:
        return self.consumed


@dataclass(slots=True)
class CountingGrammar(_CheckGrammar):
    length: int

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.failure is not None:
            return False
        if REJECTED in tokens:
            self.failure = f"token {REJECTED} is not allowed"
            return False
        self.consumed.extend(tokens)
        return True

    def is_terminated(self) -> bool:
        return self.failure is None and len(self.consumed) >= self.length


@dataclass(slots=True)
class ReplayGrammar(_CheckGrammar):
    terminated: bool = False
    # Set by the replay for the next update: what the recorded grammar did with its token.
    completes_next: bool = False
    fails_next: str | None = None
    # False while the recorded run's grammar compiled (the replay says when it was ready).
    ready: bool = True

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.fails_next is not None:
            self.failure, self.fails_next = self.fails_next, None
        if self.failure is not None:
            return False
        self.consumed.extend(tokens)
        self.terminated, self.completes_next = self.completes_next, False
        return True

    def rollback(self, num_tokens: int) -> None:
        _CheckGrammar.rollback(self, num_tokens)  # (no zero-argument super() with slots)
        self.terminated = False

    def is_terminated(self) -> bool:
        return self.terminated

    def is_ready(self) -> bool:
        return self.ready
