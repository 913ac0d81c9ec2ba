"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from slotserve.errors import RequestValidationError

# Bounds on what one request can carry (issue 11): every list is bounded, and every number
# fits what the worker holds it in (int64 rows, float32 logits) with room to spare.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20
MAX_N = 64
MAX_INT64 = 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS_VALUE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Generous bounds on what a caller may send as a constraint; a grammar library's own limits
# (and a compile time limit in the engine) bound the work beyond these.
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 1 << 20


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestValidationError(message, param)


def _check_text(value: object, param: str) -> None:
    _check(isinstance(value, str) and len(value) > 0, f"{param} must be a non-empty string",
           param)
    assert isinstance(value, str)
    _check(len(value) <= MAX_GRAMMAR_CHARS, f"{param} has {len(value)} characters, more than "
           f"the limit of {MAX_GRAMMAR_CHARS}", param)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int64(v: object, lo: int = -MAX_INT64 - 1) -> bool:
    return _is_int(v) and lo <= v <= MAX_INT64  # type: ignore[operator]


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint every generated token must keep (vLLM's names): exactly one of a JSON
    schema (`json`, a dict or its JSON text), a regular expression, a list of choices, a
    grammar (Lark, as llguidance reads it) or `json_object` (any JSON object).

    `disable_any_whitespace` (vLLM's name) is True by default here, unlike vLLM: JSON is
    written compactly, with no whitespace the schema does not ask for, so a model that writes
    noise cannot pad a bounded schema with spaces or newlines until max_tokens.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    # The request field this constraint came from: the engine's refusal of it (a grammar
    # that does not compile, or whose masks cost too much) names it, so that an API client
    # hears of the field it sent (`response_format`, `tools`), not of this one. Not part of
    # the constraint: equal constraints from two fields are equal.
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs needs exactly one of json, regex, choice, "
               f"grammar or json_object, got {given or 'none'}", "structured_outputs")
        if self.json is not None:
            _check(isinstance(self.json, str | dict),
                   "structured_outputs.json must be a JSON schema (an object or its text)",
                   "structured_outputs.json")
            if isinstance(self.json, str):
                _check_text(self.json, "structured_outputs.json")
        if self.regex is not None:
            _check_text(self.regex, "structured_outputs.regex")
        if self.grammar is not None:
            _check_text(self.grammar, "structured_outputs.grammar")
        if self.choice is not None:
            _check(isinstance(self.choice, list | tuple) and 0 < len(self.choice) <= MAX_CHOICES
                   and all(isinstance(c, str) and c for c in self.choice),
                   f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty "
                   "strings", "structured_outputs.choice")
            object.__setattr__(self, "choice", list(self.choice))
        _check(self.json_object in (None, True, False),
               "structured_outputs.json_object must be a boolean", "structured_outputs.json_object")
        _check(isinstance(self.disable_any_whitespace, bool),
               "structured_outputs.disable_any_whitespace must be a boolean",
               "structured_outputs.disable_any_whitespace")
        _check(isinstance(self.param, str) and len(self.param) > 0,
               "structured_outputs.param must be a non-empty string", "structured_outputs.param")


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
    # Constrain the output (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # `stop` as a list, checked once here; stop_token_ids as a set, so that the per-token stop
    # check is O(1) whatever the list's length.
    _stop_list: list[str] = field(default_factory=list, repr=False)
    _stop_token_set: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _check(_is_int(self.max_tokens), "max_tokens must be an integer", "max_tokens")
            _check(1 <= self.max_tokens <= MAX_INT64,
                   f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got "
               f"{self.temperature!r}", "temperature")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        # Above the vocabulary top_k changes nothing: the engine's front clamps it to 0 (off).
        _check(_is_int64(self.top_k, -1),
               f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}",
               "top_k")
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        _check(self.seed is None or _is_int64(self.seed),
               f"seed must be a 64-bit signed integer, got {self.seed!r}", "seed")
        _check(_is_int64(self.min_tokens, 0),
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
        _check(_is_num(self.repetition_penalty)
               and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
               f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
               "repetition_penalty")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}",
               "n")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stops),
               "stop must be a non-empty string or a list of non-empty strings", "stop")
        _check(len(stops) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in stops),
               f"a stop string has at most {MAX_STOP_STRING_CHARS} characters", "stop")
        self._stop_list = stops
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            _check(isinstance(ids, list | tuple), "stop_token_ids must be a list of non-negative "
                   "integers", "stop_token_ids")
            _check(len(ids) <= MAX_STOP_TOKEN_IDS,
                   f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}",
                   "stop_token_ids")
            _check(all(_is_int64(t, 0) for t in ids),
                   "stop_token_ids must be a list of non-negative integers", "stop_token_ids")
            self.stop_token_ids = list(ids)
            self._stop_token_set = frozenset(ids)
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(isinstance(bias, dict), "logit_bias must map token ids to numbers",
                   "logit_bias")
            _check(len(bias) <= MAX_LOGIT_BIAS,
                   f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(bias)}", "logit_bias")
            _check(all(_is_int64(t, 0) and _is_num(v) and abs(v) <= MAX_LOGIT_BIAS_VALUE
                       for t, v in bias.items()),
                   f"logit_bias maps token ids to numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                   f"{MAX_LOGIT_BIAS_VALUE:g}]", "logit_bias")
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   "structured_outputs must be a StructuredOutputsParams", "structured_outputs")
            # Below min_tokens EOS is held back, but a finished grammar allows nothing else.
            _check(self.min_tokens == 0, "min_tokens cannot be combined with structured "
                   "outputs (the grammar decides where the output ends)", "min_tokens")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def stop_token_set(self) -> frozenset[int]:
        return self._stop_token_set

    def clone(self, **changes: object) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
