"""The messages between the scheduler, the worker and the engine (DESIGN.md section 2).

`SchedulerOutput` is the whole scheduler-to-worker contract: the worker never sees a Request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def released_req_ids(self) -> set[str]:
        return self.finished_req_ids | self.preempted_req_ids


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


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # "stop", "length", "abort", "error" or None. A streaming session's chunk boundary also
    # carries a finish reason while `finished` stays False (the session pauses).
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[LogprobsEntry] | None = None
    num_cached_tokens: int = 0
    # True when the request is over and its resources are released.
    finished: bool = False
    # Why a request was refused or ended by the engine (FINISHED_IGNORED, session timeout).
    finish_message: str | None = None
