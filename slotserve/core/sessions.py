"""Streaming-input sessions (DESIGN.md section 3): one component, composed by the scheduler.

A session is a resumable request. When a chunk's generation stops, the session always stops
first and waits for its next chunk, keeping its KV blocks and worker slot: an idle session
(status WAITING_FOR_STREAMING_REQ; vLLM's "paused" means the whole engine, hence another
name). A chunk that arrives meanwhile is folded in when the session is promoted, and the
session comes back in scheduled_new_reqs with all its blocks. A non-resumable request with the
session's id ends it, and so does an idle timeout.

An idle session's worker slot is its own only for a while (issue 11): once it has been idle
longer than the grace period, a waiting request that finds no free slot takes the slot of the
least important, longest-idle session; a request that was already waiting when the session
paused, and is at least as important, takes it at once (it was there first: the grace period
protects a session against newcomers, not against those it overtook while it ran); and at
most `max_idle` idle sessions keep slot and KV at all. The scheduler takes them as a
preemption (reported in preempted_req_ids, KV freed); the session stays open with its tokens and recomputes them when its next chunk comes.

Time enters as an argument (`now`, the engine's clock, given to Scheduler.schedule and
update_from_output), so a recorded trace replays idle timeouts exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from slotserve.core.kv_cache_manager import KVCacheManager
from slotserve.core.outputs import FinishReason
from slotserve.core.request import Request, RequestStatus
from slotserve.core.request_queue import RequestQueue
from slotserve.errors import RequestValidationError

IDLE = RequestStatus.WAITING_FOR_STREAMING_REQ
# Idle sessions are looked at for timeouts at most this often (seconds of `now`).
TIMEOUT_CHECK_INTERVAL_S = 1.0


def kept_output_tokens(num_output_tokens: int) -> int:
    # The fold rule: of a stopped chunk's outputs, a session keeps all but the last sampled
    # token, which was never fed through the model.
    return max(0, num_output_tokens - 1)


# How the scheduler ends a request it holds: set the status, free it, report the end
# (request, status, message, rejected, why the session ended).
EndRequest = Callable[[Request, RequestStatus, str | None, bool, FinishReason | None], None]


# Whether the worker holds a slot for a request id (the scheduler's SlotLedger.holds).
HoldsSlot = Callable[[str], bool]


@dataclass(slots=True)
class StreamingSessions:
    timeout_s: float
    kv_cache_manager: KVCacheManager
    waiting: RequestQueue
    end_request: EndRequest
    # Scheduler.report_end: how a refused chunk is reported.
    report_end: Callable[..., None]
    # How long an idle session keeps a slot that a waiting request needs, and how many idle
    # sessions may keep slot and KV at all (None: no cap).
    grace_s: float = 1.0
    max_idle: int | None = None
    # Idle sessions (they keep KV + slot), and the `now` at which each stopped.
    idle: dict[str, Request] = field(default_factory=dict)
    idle_since: dict[str, float] = field(default_factory=dict)
    # Per session: chunks (later Requests with its id; None: the end mark) that arrived while
    # it was not idle.
    queued: dict[str, deque[Request | None]] = field(default_factory=dict)
    next_timeout_check: float = 0.0
    # Idle sessions whose slot was taken (past the grace period, or over the cap); counted
    # for stats only.
    num_slots_reclaimed: int = 0

    def start(self, request: Request) -> None:
        """A new request; a resumable one opens a session."""
        if request.resumable:
            self.queued[request.request_id] = deque()

    def forget(self, request_id: str) -> None:
        """The scheduler freed the request: its session, if any, is over."""
        self.idle.pop(request_id, None)
        self.idle_since.pop(request_id, None)
        self.queued.pop(request_id, None)

    def add_chunk(self, session: Request, request: Request) -> None:
        """A later request with a session's id: its next chunk, or (not resumable) its end."""
        queue = self.queued.get(session.request_id)
        if queue is None:
            raise RequestValidationError(
                f"duplicate request id {request.request_id!r} (not a streaming session)",
                "request_id")
        queue.append(request if request.resumable else None)
        self._apply_queued(session, queue)

    def on_stop(self, request: Request, now: float) -> bool:
        """A stopped request: True if it is finished, False if a session went idle (or was
        promoted at once with a chunk that was waiting)."""
        queue = self.queued.get(request.request_id)
        if queue is None:
            return True
        if queue and queue[0] is None:
            return True
        # Always idle first (vLLM PR #52717); a queued chunk is applied by promotion.
        request.status = IDLE
        self.idle[request.request_id] = request
        self.idle_since[request.request_id] = now
        self._apply_queued(request, queue)
        return False

    def _apply_queued(self, session: Request, queue: deque[Request | None]) -> None:
        """An idle session takes its next queued chunk (or ends on its end mark); a chunk
        refused (it does not fit) is skipped, the session staying idle."""
        while queue and session.request_id in self.idle:
            update = queue.popleft()
            if update is None:
                self.end_request(session, RequestStatus.FINISHED_ABORTED, None, False,
                                 FinishReason.END)
            else:
                self._promote(session, update)

    def expire(self, now: float) -> None:
        """End the sessions idle for longer than the timeout."""
        if now < self.next_timeout_check:
            return
        self.next_timeout_check = now + TIMEOUT_CHECK_INTERVAL_S
        expired = [r for rid, r in self.idle.items()
                   if now - self.idle_since[rid] > self.timeout_s]
        for r in expired:
            self.end_request(r, RequestStatus.FINISHED_ABORTED,
                             f"streaming session idle for more than {self.timeout_s:g} s",
                             False, FinishReason.IDLE_TIMEOUT)

    def slot_for_waiting(self, now: float, holds_slot: HoldsSlot,
                         waiter: Request) -> Request | None:
        """The idle session whose slot `waiter` (a waiting request with no slot) may take,
        the least important first (the largest priority value), then the longest idle; None
        when there is none. Any session that holds a slot and gives it up
        (gives_slot_to)."""
        candidates = [r for rid, r in self.idle.items()
                      if holds_slot(rid) and self.gives_slot_to(r, waiter, now)]
        return max(candidates, key=self._reclaim_rank, default=None)

    def gives_slot_to(self, session: Request, waiter: Request, now: float) -> bool:
        """Whether an idle session gives its slot to a waiting request: past the grace
        period always; within it, only to a request that arrived before the session paused
        (its arrival_time, on the engine's clock: it may have waited in the front's admission
        queue, or for its grammar, all that time) and is at least as important (priority
        value no larger)."""
        since = self.idle_since[session.request_id]
        return now - since > self.grace_s or (waiter.arrival_time < since
                                              and waiter.priority <= session.priority)

    def over_cap(self, holds_slot: HoldsSlot) -> list[Request]:
        """The idle sessions that must give up slot and KV so that at most max_idle keep
        them: the least important, longest idle ones."""
        cap = self.max_idle
        if cap is None or len(self.idle) <= cap:
            return []
        holds = self.kv_cache_manager.holds_blocks
        holders = [r for rid, r in self.idle.items() if holds_slot(rid) or holds(rid)]
        if len(holders) <= cap:
            return []
        holders.sort(key=self._reclaim_rank, reverse=True)
        return holders[:len(holders) - cap]

    def kv_holders(self) -> list[Request]:
        """The requests that hold KV while not running: idle sessions, waiting promoted ones."""
        holds = self.kv_cache_manager.holds_blocks
        out = [r for r in self.idle.values() if holds(r.request_id)]
        out.extend(r for r in self.waiting if holds(r.request_id))
        return out

    def _reclaim_rank(self, request: Request) -> tuple[int, float]:
        """Which idle session gives up its slot first: the highest rank, i.e. the least
        important (largest priority value), then the longest idle. Ties keep idle order."""
        return request.priority, -self.idle_since[request.request_id]

    def _promote(self, session: Request, update: Request) -> None:
        """Fold the next chunk into an idle session and queue it; it keeps KV and slot. A
        chunk the session cannot hold (the core alone knows its exact length) is refused as
        that chunk: the session stays idle, as it was."""
        num_tokens = (session.num_tokens - session.num_output_tokens
                      + kept_output_tokens(session.num_output_tokens)
                      + len(update.prompt_token_ids))
        reason = self.kv_cache_manager.unfittable_reason(num_tokens)
        if reason is not None:
            self.report_end(session.request_id, FinishReason.LENGTH.value, reason, True,
                            chunk=update.chunk, finished=False)
            return
        fold(session, update)
        self.kv_cache_manager.truncate_hashes(session)
        del self.idle[session.request_id], self.idle_since[session.request_id]
        # Ahead of newcomers (FCFS): it already holds resources the worker keeps for it.
        holds = self.kv_cache_manager.holds_blocks
        self.waiting.add_resumed_request(
            session, lambda r: r.status == RequestStatus.WAITING and holds(r.request_id))


def fold(request: Request, update: Request) -> None:
    """Apply the next input chunk to a stopped session.

    The outputs become part of the prompt, except the last sampled token (kept_output_tokens);
    then the chunk is appended and its sampling params take over (a grammar, set by the
    session's first chunk, goes on constraining the outputs). Dropping exactly that one
    token (rather than everything past num_computed_tokens) keeps the history intact when the
    session's KV was reclaimed and num_computed_tokens is 0.
    """
    tokens = request.all_token_ids
    kept = kept_output_tokens(request.num_output_tokens)
    if request.structured_output_request is not None:
        # The session's grammar spans its chunks: it forgets the dropped token too.
        request.structured_output_request.on_fold(request.output_token_ids, kept)
    del tokens[request.num_tokens - request.num_output_tokens + kept:]
    tokens.extend(update.prompt_token_ids)
    request.output_token_ids.clear()
    request.prompt_token_ids = list(tokens)
    # Computed KV beyond the kept tokens is stale; a zero-token continuation recomputes the
    # last kept token so that the step has something to sample from.
    request.num_computed_tokens = min(request.num_computed_tokens, len(tokens) - 1)
    request.sampling_params = update.sampling_params
    request.max_tokens = update.sampling_params.max_tokens
    request.eos_token_id = update.eos_token_id
    request.arrival_time = update.arrival_time
    request.priority = update.priority
    request.chunk = update.chunk
    request.stop_reason = None
    request.status = RequestStatus.WAITING
