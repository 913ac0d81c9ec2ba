"""SpeculativeConfig: vLLM's `speculative_config` for the methods that need no draft model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from slotserve.errors import ConfigError

SpecMethod = Literal["ngram", "suffix"]
METHODS: tuple[str, ...] = ("ngram", "suffix")


def _fail(field: str, message: str) -> ConfigError:
    return ConfigError(f"speculative_config.{field}: {message}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpecMethod = "ngram"
    # Drafts proposed per request and step (k): a verify step yields up to k + 1 tokens.
    num_speculative_tokens: int = 4
    # ngram (prompt lookup): the longest n-gram in [min, max] that ends the sequence and
    # occurred before proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # suffix (Arctic Inference's names): the longest matched suffix considered, how many
    # finished requests' outputs the global cache keeps, and drafts per matched token.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    # Off: every step speculates when a proposal exists (tests); on: only where the measured
    # acceptance and verify cost predict a gain (spec_decode/policy.py).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _fail("method", f"unknown method {self.method!r}; slotserve has "
                        f"{', '.join(METHODS)}")
        ints = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise _fail(name, f"must be an integer, got {value!r}")
        for name in ints[:4]:
            if getattr(self, name) < 1:
                raise _fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens > 32:
            raise _fail("num_speculative_tokens", "must be <= 32")
        if self.suffix_decoding_max_cached_requests < 0:
            raise _fail("suffix_decoding_max_cached_requests", "must be >= 0")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _fail("prompt_lookup_min", f"{self.prompt_lookup_min} is larger than "
                        f"prompt_lookup_max={self.prompt_lookup_max}")
        f = self.suffix_decoding_max_spec_factor
        if not isinstance(f, int | float) or isinstance(f, bool) or not 0 < f <= 64:
            raise _fail("suffix_decoding_max_spec_factor", f"must be a number in (0, 64], "
                        f"got {f!r}")
        if not isinstance(self.adaptive, bool):
            raise _fail("adaptive", "must be true or false")

    @classmethod
    def from_any(cls, value: object) -> SpeculativeConfig | None:
        """A config from `LLM(speculative_config={...})`, a JSON string (the command line's
        --speculative-config) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config: not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: must be a JSON object (a dict)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _fail(unknown[0], f"unknown field; known: {', '.join(sorted(known))}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        # The command-line form (engine_flags passes str(value) to a child process).
        return json.dumps(self.to_dict())
