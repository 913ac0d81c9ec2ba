"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slotserve.errors import RequestValidationError

MAX_STOP_STRINGS = 32
MAX_LOGPROBS = 20
MAX_N = 64


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestValidationError(message, param)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # `stop` as a list, checked once here.
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _check(_is_int(self.max_tokens), "max_tokens must be an integer", "max_tokens")
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}",
                   "max_tokens")
        _check(_is_num(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
               f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}",
               "top_k")
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        _check(self.seed is None or _is_int(self.seed), "seed must be an integer", "seed")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                   "min_tokens")
        if self.logprobs is not None:
            _check(_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                   f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                   "logprobs")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            _check(_is_num(v) and lo <= v <= hi, f"{name} must be in [{lo}, {hi}], got {v!r}", name)
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
               "repetition_penalty")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}",
               "n")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stops),
               "stop must be a non-empty string or a list of non-empty strings", "stop")
        _check(len(stops) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        self._stop_list = stops
        if self.stop_token_ids is not None:
            _check(isinstance(self.stop_token_ids, list | tuple)
                   and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                   "stop_token_ids must be a list of non-negative integers", "stop_token_ids")
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    def clone(self, **changes: object) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
