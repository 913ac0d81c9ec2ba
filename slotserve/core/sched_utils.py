"""Stop conditions and the stats snapshot, kept apart from the step loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slotserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from slotserve.core.scheduler import Scheduler


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_paused_sessions: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Worker slots held (by running requests, idle sessions, promoted ones), and idle
    # sessions whose slot a waiting request took (issue 11).
    num_slots_held: int = 0
    num_idle_slots_reclaimed: int = 0
    num_waiting_for_grammar: int = 0
    # Speculative decoding (vLLM's names): verified proposals, their draft tokens, the
    # accepted ones, and accepted drafts by position (1st, 2nd, ...).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the last appended token ends the request; sets status and stop_reason.

    Below min_tokens neither EOS nor a stop token ends it (vLLM 0.33 lets them through and
    relies on the sampler; we enforce it here too), but the length caps still apply.
    """
    n_out = request.num_output_tokens
    params = request.sampling_params
    sor = request.structured_output_request
    if sor is not None and sor.grammar.is_terminated():
        # The grammar is complete (it allows only EOS now), also for a request that ignores
        # EOS; min_tokens cannot be combined with a grammar (SamplingParams).
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if n_out >= params.min_tokens:
        last = request.all_token_ids[-1]
        if last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        # A set: O(1) per token however many stop ids the request carries.
        if last in params.stop_token_set:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_tokens >= max_model_len or (
            request.max_tokens is not None and n_out >= request.max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def make_stats(sched: Scheduler) -> SchedulerStats:
    kv = sched.kv_cache_manager
    return SchedulerStats(
        num_running_reqs=len(sched.running),
        num_waiting_reqs=len(sched.waiting),
        num_paused_sessions=len(sched.sessions.idle),
        kv_cache_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_stats.queries,
        prefix_cache_hits=kv.prefix_cache_stats.hits,
        num_preemptions=sched.num_preemptions,
        num_slots_held=len(sched.slot_ledger.holders),
        num_idle_slots_reclaimed=sched.sessions.num_slots_reclaimed,
        num_waiting_for_grammar=len(sched.waiting_for_grammar),
        **(sched.spec.stats_fields() if sched.spec is not None else {}),
    )


def append_generated(request: Request, generated: list[int],
                     max_model_len: int) -> tuple[int, bool, str | None, str | None]:
    """Append one step's sampled tokens until one ends the request. Returns how many were
    appended, whether it stopped, and for a grammar failure its message and refusal code."""
    sor = request.structured_output_request
    n_new = 0
    for t in generated:
        request.append_output_token_ids(t)
        n_new += 1
        if sor is not None and not sor.grammar.accept_tokens([t]):
            # The bitmask allowed only what the grammar accepts, so this is the grammar
            # library failing (a resource limit): the output would break; or the engine
            # refused the grammar (its masks' cost): the client's fault.
            request.status = RequestStatus.FINISHED_ERROR
            refusal = sor.grammar.refusal
            message = (sor.grammar.error if refusal is not None
                       else f"structured output failed: {sor.grammar.error}")
            return n_new, True, message, refusal
        if check_stop(request, max_model_len):
            return n_new, True, None, None
    return n_new, False, None, None
