"""llguidance behind the engine's grammar interface.

`GuidanceBackend` turns grammar texts into compiled matchers for one tokenizer (built lazily,
once, from the model's Hugging Face fast tokenizer); `GuidanceGrammar` is one request's
matcher, a copy of the compiled one, seen by the scheduler through
slotserve.core.structured_output.StructuredOutputGrammar.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from slotserve.errors import SlotServeError
from slotserve.memory import trim_heap


class GrammarCompileError(SlotServeError):
    """A grammar did not compile for this tokenizer (the library's message), or not in time."""


def allocate_bitmask(rows: int, vocab_size: int) -> npt.NDArray[np.int32]:
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


class GuidanceGrammar:
    """One request's matcher; it records what it consumed so the checker can compare."""

    __slots__ = ("matcher", "_consumed", "_error")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self._consumed: list[int] = []
        self._error: str | None = None

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self._error is not None:
            return False
        if not self.matcher.consume_tokens(tokens):
            self._error = self.matcher.get_error() or "the grammar rejected a token"
            return False
        self._consumed.extend(tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if not self.matcher.rollback(num_tokens):
            self._error = self.matcher.get_error() or "rollback failed"
        del self._consumed[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._error is None and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def consumed_token_ids(self) -> list[int]:
        return self._consumed

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """The tokens allowed next (EOS only once the grammar is complete)."""
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)


class GuidanceBackend:
    """Compiles grammar texts for one tokenizer; thread-safe (compiles run off the step
    loop)."""

    def __init__(self, load_tokenizer: Callable[[], tuple[Any, Sequence[int]]],
                 vocab_size: int) -> None:
        """`load_tokenizer()` gives the model's Hugging Face tokenizer and its EOS ids (the
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
                # Imported here: it imports transformers (20 MB resident), which an engine
                # core that never sees a grammar does not need.
                import llguidance.hf

                hf, eos_ids = self._load_tokenizer()
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        hf, n_vocab=max(self.vocab_size, len(hf)),
                        eos_token=list(eos_ids) or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise GrammarCompileError(
                        f"structured outputs need a fast tokenizer: {exc}") from exc
                finally:
                    # The Hugging Face tokenizer and the build's temporaries (about 400 MB for
                    # a 262k vocabulary) are garbage now: hand their heap back.
                    del hf
                    trim_heap()
            return self._tokenizer

    def prepare(self) -> None:
        """Build the tokenizer now (GrammarCompileError if it cannot be)."""
        self.ll_tokenizer  # noqa: B018 - the property builds it

    def compile(self, grammar: str, limits: llguidance.LLParserLimits | None = None
                ) -> llguidance.LLMatcher:
        """A matcher in its initial state, its first mask computed (the lexer builds lazily,
        and its errors show only then); raises GrammarCompileError."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            scratch = allocate_bitmask(1, self.ll_tokenizer.vocab_size)
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error().strip())
        return matcher
