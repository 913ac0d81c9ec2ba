"""llguidance behind the engine's grammar interface.

`GuidanceBackend` turns grammar texts into compiled matchers for one tokenizer (built lazily,
once, from the model's fast tokenizer); `GuidanceGrammar` is one request's
matcher, a copy of the compiled one, seen by the scheduler through
slotserve.core.structured_output.StructuredOutputGrammar.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from slotserve.checkpoint.tokenizer import backend_tokenizer
from slotserve.errors import InvariantViolation, SlotServeError
from slotserve.memory import trim_heap
from slotserve.structured_output.limits import error_excerpt, parser_limits


class GrammarCompileError(SlotServeError):
    """A grammar did not compile for this tokenizer (the library's message), or not in time."""


def allocate_bitmask(rows: int, vocab_size: int) -> npt.NDArray[np.int32]:
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


class GuidanceGrammar:
    """One request's matcher; it records what it consumed so the checker can compare."""

    __slots__ = ("matcher", "_consumed", "_error", "_refusal")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self._consumed: list[int] = []
        self._error: str | None = None
        self._refusal: str | None = None

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self._error is not None:
            return False
        if not self.matcher.consume_tokens(tokens):
            self._error = error_excerpt(self.matcher.get_error() or "the grammar rejected a token")
            return False
        self._consumed.extend(tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if not self.matcher.rollback(num_tokens):
            self._error = error_excerpt(self.matcher.get_error() or "rollback failed")
        del self._consumed[-num_tokens:]

    def validate_tokens(self, tokens: list[int]) -> int:
        if self._error is not None:
            return 0
        return int(self.matcher.validate_tokens(tokens))

    def refuse(self, message: str, code: str) -> None:
        """Fail this matcher: the next token it is given is refused with `message`, and its
        request ends rejected with `code` (StructuredOutputGrammar.refusal)."""
        if self._error is None:
            self._error, self._refusal = message, code

    def is_terminated(self) -> bool:
        return self._error is None and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def consumed_token_ids(self) -> list[int]:
        return self._consumed

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int,
                     drafts: Sequence[int] = ()) -> None:
        """The tokens allowed next (EOS only once the grammar is complete) in `row`; with
        speculative drafts (the grammar accepts them: the scheduler cut them so), those
        allowed after each one in the rows after it. The matcher ends where it started."""
        for i in range(len(drafts) + 1):
            view = bitmask[row + i]
            self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
            if i < len(drafts) and not self.matcher.consume_token(drafts[i]):
                raise InvariantViolation(f"the grammar refused draft {drafts[i]} it validated")
        if drafts and not self.matcher.rollback(len(drafts)):
            raise InvariantViolation(self.matcher.get_error() or "rollback failed")


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a fast tokenizer (transformers' or a SavedTokenizer): what
    `llguidance.hf.from_tokenizer` builds (the Rust tokenizer's JSON without padding or
    truncation), without importing transformers (20 MB resident) into the engine core."""
    try:
        backend = copy.copy(backend_tokenizer(tokenizer))
    except TypeError as exc:  # a slow (Python) tokenizer
        raise GrammarCompileError(f"structured outputs need a fast tokenizer: {exc}") from exc
    backend.no_padding()
    backend.no_truncation()
    eos: list[int] | int | None = list(eos_ids) or getattr(tokenizer, "eos_token_id", None)
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=max(vocab_size, len(tokenizer)),
                                  eos_token=eos)


class GuidanceBackend:
    """Compiles grammar texts for one tokenizer; thread-safe (compiles run off the step
    loop)."""

    def __init__(self, load_tokenizer: Callable[[], tuple[Any, Sequence[int]]],
                 vocab_size: int) -> None:
        """`load_tokenizer()` gives the model's fast tokenizer and its EOS ids (the
        tokens a complete grammar allows); `vocab_size` is the width of the model's logits."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about 3 s and 280 MB resident for Gemma 3's 262k vocabulary):
        engines that never see a grammar never pay for it."""
        with self._lock:
            if self._tokenizer is None:
                tokenizer, eos_ids = self._load_tokenizer()
                try:
                    self._tokenizer = ll_tokenizer(tokenizer, self.vocab_size, eos_ids)
                finally:
                    # The tokenizer and the build's temporaries (about 400 MB for a 262k
                    # vocabulary) are garbage now: hand their heap back.
                    del tokenizer
                    trim_heap()
            return self._tokenizer

    def prepare(self) -> None:
        """Build the tokenizer now (GrammarCompileError if it cannot be)."""
        self.ll_tokenizer  # noqa: B018 - the property builds it

    def compile(self, grammar: str, limits: llguidance.LLParserLimits | None = None
                ) -> llguidance.LLMatcher:
        """A matcher in its initial state that got through a first step (see
        `first_step_error`); raises GrammarCompileError with a bounded excerpt of the
        library's message."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                       limits=limits or parser_limits())
        error = (matcher.get_error() if matcher.is_error()
                 else first_step_error(matcher, self.ll_tokenizer))
        if error:
            raise GrammarCompileError(error_excerpt(error))
        return matcher


def first_step_error(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> str:
    """Why the matcher fails within its first token ('' when it does not), leaving it in its
    initial state. The lexer builds lazily, and llguidance gives up on some grammars only when
    it computes the first mask or the one after the first token (a regex `a{1000000}`, the
    empty language `start: "a" start`, counted repetitions nested three deep): caught here,
    at compile, those are a 400 for their client instead of a failed step."""
    scratch = allocate_bitmask(1, tokenizer.vocab_size)
    matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    if matcher.is_error():
        return matcher.get_error()
    bits = np.unpackbits(scratch.view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
    bits[list(tokenizer.eos_tokens)] = 0  # EOS ends the matcher: a step that proves nothing
    allowed = np.flatnonzero(bits)
    if not len(allowed):
        return ""
    if matcher.consume_token(int(allowed[0])) and not matcher.is_stopped():
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    if matcher.is_error():
        return matcher.get_error()
    matcher.reset()
    return ""
