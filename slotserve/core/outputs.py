"""The messages between the scheduler, the worker and the engine (DESIGN.md section 2).

`SchedulerOutput` is the whole scheduler-to-worker contract: the worker never sees a Request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request that (re)claims a worker slot this step."""

    req_id: str
    prompt_token_ids: list[int]
    # Prompt plus any tokens kept across a preemption or earlier session chunks: what the
    # worker must treat as the prefill contents.
    prefill_token_ids: list[int]
    # All of the request's KV blocks, not only the new ones.
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    # Tokens at the end of prefill_token_ids that are outputs (kept across a preemption);
    # the worker needs them for penalties and for the seeded sampler's position.
    num_output_tokens: int = 0
    # None when the request ignores EOS; the sampler masks it below min_tokens.
    eos_token_id: int | None = None
    # The worker's adapter slot its tokens use (SchedulerOutput.lora_loads); -1: the base.
    lora_slot: int = -1


@dataclass(slots=True)
class CachedRequestData:
    """Requests that already hold a worker slot and are scheduled again."""

    req_ids: list[str] = field(default_factory=list)
    # Per request: blocks added this step, or None when there are none.
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Slot releases; each id is delivered in exactly one output.
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding: per request, the draft tokens scheduled after its last token
    # (counted in num_scheduled_tokens); the worker verifies them in this step's pass.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Adapter slot -> the adapter the worker loads there before this step (core/lora_slots.py:
    # only slots no request uses change).
    lora_loads: dict[int, LoRARequest] = field(default_factory=dict)

    @property
    def released_req_ids(self) -> set[str]:
        return self.finished_req_ids | self.preempted_req_ids


@dataclass(slots=True)
class GrammarOutput:
    """The token bitmask of one step (vLLM's name), beside its SchedulerOutput: row i is for
    structured_output_request_ids[i], a request that samples in this step; bit t of a row
    (little-endian within each int32) allows token t. `wait` blocks until the rows are filled:
    the engine fills them on another thread while the forward pass runs."""

    structured_output_request_ids: list[str]
    # An int32 numpy array [rows, ceil(vocab / 32)], typed loosely: the contract (like core/)
    # imports neither numpy nor torch.
    grammar_bitmask: Any
    wait: Callable[[], None] | None = None

    def ready_bitmask(self) -> Any:
        if self.wait is not None:
            self.wait()
        return self.grammar_bitmask


# One logprobs entry per sampled token: token id -> logprob (the sampled token and the top N).
LogprobsEntry = dict[int, float]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request index: the tokens sampled this step (empty during a partial prefill).
    sampled_token_ids: list[list[int]]
    # Per request index: one LogprobsEntry per sampled token, or None when not requested.
    logprobs: list[list[LogprobsEntry] | None] | None = None
    # Requests of this step the worker could not run (it isolated the failure to them: the
    # rest of the batch ran normally), with what went wrong. The scheduler ends them with an
    # error; they are not among req_ids.
    failed: dict[str, str] | None = None


class FinishReason(enum.StrEnum):
    """A request or a session's chunk ends with STOP, LENGTH, ABORT or ERROR (as the API
    spells them); a session with END (its end mark), IDLE_TIMEOUT, LENGTH (it outgrew the KV
    cache), REFUSED (its first chunk was) or ERROR: what /v1/sessions' session.done says."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    END = "end"
    IDLE_TIMEOUT = "idle_timeout"
    REFUSED = "refused"


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # "stop", "length", "abort", "error" or None (a FinishReason's value).
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[LogprobsEntry] | None = None
    num_cached_tokens: int = 0
    # True when the request is over and its resources are released.
    finished: bool = False
    # Why a request was refused or ended by the engine (FINISHED_IGNORED, session timeout).
    finish_message: str | None = None
    # The engine refused the request as invalid before running it (its grammar did not
    # compile, or not in time): finish_reason is "error", finish_message the reason, and the
    # front reports it as a bad request (HTTP 400), not as a failed model step.
    rejected: bool = False
    # A session's events, each for the chunk it names (the index the front gave it): the
    # output ends its chunk (chunk_done: it stopped, or was refused, `rejected`), and the
    # session waits for its next one, or the session is over too (finished, and session_end
    # says why; an end between chunks is an output of the last chunk, not chunk_done).
    chunk: int = 0
    chunk_done: bool = False
    session_end: FinishReason | None = None
    # With `rejected`: a code naming why (e.g. "grammar_too_expensive"), for the error body.
    error_code: str | None = None
