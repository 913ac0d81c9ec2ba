"""A request's grammar as the scheduler sees it (vLLM's StructuredOutputRequest).

The matcher state lives here, on the scheduler's side, as in vLLM: the scheduler is the one
place that knows which sampled tokens a request keeps (a stop cuts a step's tokens, a
preemption keeps its outputs, a session's fold drops the last sampled token), so it advances
the grammar with exactly those. The engine reads the grammars of the requests that sample in
a step to build that step's token bitmask (slotserve.structured_output); the worker only
applies the bitmask. This module stays free of the grammar library and of torch: anything
with the `StructuredOutputGrammar` methods will do (llguidance in the engine, counting fakes
in the checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class StructuredOutputGrammar(Protocol):
    """One request's matcher: it consumes the tokens the request keeps, in order."""

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance; False when the tokens break the grammar (the matcher is then in error)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        ...

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept next (nothing advances):
        speculative drafts are cut at the first token it refuses."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (EOS aside)."""
        ...

    def is_ready(self) -> bool:
        """Compiled, or failed to compile (`error` says why); until then its request waits
        with status WAITING_FOR_GRAMMAR."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher failed (it never recovers), or None."""
        ...

    @property
    def refusal(self) -> str | None:
        """A code (e.g. "grammar_too_expensive") when the engine refused to follow the grammar
        any further (its `error` says why): the client's request is at fault, not the model
        step, so its request ends rejected. None when the grammar failed otherwise."""
        ...

    @property
    def consumed_token_ids(self) -> list[int]:
        """Every token accepted and not rolled back, in order (the checker compares it with
        the request's outputs)."""
        ...


@dataclass(slots=True)
class StructuredOutputRequest:
    grammar: StructuredOutputGrammar
    # A streaming session's grammar spans its chunks: the outputs its earlier chunks kept
    # (folded into the prompt since) were consumed before this chunk's outputs.
    prior_output_token_ids: list[int] = field(default_factory=list)

    def expected_token_ids(self, output_token_ids: list[int]) -> list[int]:
        """What the grammar must have consumed, given the current chunk's outputs."""
        return self.prior_output_token_ids + output_token_ids

    def on_fold(self, output_token_ids: list[int], num_kept: int) -> None:
        """A session chunk ended and its outputs fold into the prompt, all but the last
        sampled token: the grammar forgets that token too (it is sampled again after the next
        chunk) and keeps the rest as consumed history."""
        dropped = len(output_token_ids) - num_kept
        if dropped:
            self.grammar.rollback(dropped)
        self.prior_output_token_ids.extend(output_token_ids[:num_kept])
