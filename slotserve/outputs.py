"""What the engine hands back to callers: one RequestOutput per request per step.

These are plain records; the engine fills them in `slotserve.engine.output_processor`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from slotserve.core.outputs import FinishReason, LogprobsEntry


class RequestOutputKind(enum.Enum):
    """How much of a request's output each RequestOutput carries (vLLM's names)."""

    # Text, token ids and logprobs so far (the default; what ENGINE_API.md describes).
    CUMULATIVE = 0
    # Only what is new since the previous output of the same request (for streaming servers).
    DELTA = 1
    # Nothing until the request finishes (offline `LLM.generate`; saves copying per step).
    FINAL_ONLY = 2


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) recorded by the engine while a request runs.

    Histograms (TTFT, inter-token latency, ...) are computed from these outside the engine
    loop, so the loop only appends floats.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # One entry per step that produced tokens: the time the engine saw them.
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One entry per generated token (token id -> logprob), or None when not requested.
    logprobs: list[LogprobsEntry] | None
    # "stop", "length", "abort", "error" or None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence, if any.
    stop_reason: int | str | None = None
    # Why the engine refused or ended the sequence itself (a prompt that can never fit, an
    # idle streaming session, a failed forward pass); None otherwise.
    finish_message: str | None = None
    # The engine refused the request as invalid before running it (its grammar did not
    # compile, or not in time): finish_reason is "error" and finish_message says why.
    # AsyncLLM.generate and LLM.generate raise RequestValidationError for it instead.
    rejected: bool = False
    # With `rejected`: a code naming why (e.g. "grammar_too_expensive"), for the error body.
    error_code: str | None = None
    # With `rejected`: the request field refused, the one its constraint came from
    # (StructuredOutputsParams.param); None when the request had no constraint (a session's
    # chunk that does not fit).
    error_param: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # True once the request (a streaming session: the whole session) is over.
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # A streaming session's events: the chunk this output belongs to (the index it was
    # submitted with), whether the output ends that chunk (its finish_reason says how; the
    # session waits for the next; `rejected`: the chunk was refused, the session goes on), and
    # once `finished`, why the session ended (end, idle_timeout, length, refused, error).
    chunk: int = 0
    chunk_done: bool = False
    session_end: FinishReason | None = None
