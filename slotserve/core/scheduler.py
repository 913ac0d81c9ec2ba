"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill and decode phases. Each request has a cursor, num_computed_tokens, that
chases num_tokens; a step hands out tokens under max_num_batched_tokens. Worker slots are
counted by the SlotLedger, which mirrors the worker's table from the outputs emitted here.
"""

from __future__ import annotations

from collections.abc import Iterable

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.block_pool import KVCacheBlock
from slotserve.core.fairness import fair_key, fair_queue, fair_victim, slots_by_client
from slotserve.core.kv_cache_manager import KVCacheManager
from slotserve.core.lora_slots import LoRASlotLedger
from slotserve.core.output_builder import build_output
from slotserve.core.outputs import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from slotserve.core.request import CHECK_REQUESTS, Request, RequestStatus, check_new_request
from slotserve.core.request_queue import create_request_queue
from slotserve.core.sched_utils import SchedulerStats, append_generated, make_stats
from slotserve.core.sessions import StreamingSessions
from slotserve.core.slot_ledger import SlotLedger
from slotserve.spec_decode.scheduling import SpecDecodeScheduler

RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(cache_config.block_size, cache_config.num_blocks,
                                               cache_config.enable_prefix_caching,
                                               scheduler_config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Requests whose grammar compiles, in arrival order: they join `waiting` when ready.
        self.waiting_for_grammar: dict[str, Request] = {}
        # Releases since the last schedule(); swapped out (not cleared) with each output.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.slot_ledger = SlotLedger(scheduler_config.max_num_seqs)
        self.lora_slots = LoRASlotLedger(scheduler_config.max_loras)
        # Outputs of requests that ended outside update_from_output (refused, timed out, ...),
        # returned by the next update_from_output.
        self.pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # Live requests per named client (the server's): while two or more clients have
        # some, the FCFS queue is fair among them (fairness.py).
        self.live_clients: dict[str, int] = {}
        self.sessions = StreamingSessions(scheduler_config.streaming_session_timeout_s,
                                          self.kv_cache_manager, self.waiting, self._end_request,
                                          self.report_end,
                                          scheduler_config.idle_slot_grace_s,
                                          scheduler_config.max_idle_sessions)
        # The engine's clock as of the latest schedule(now) or update_from_output(..., now):
        # sessions go idle and time out against it.
        self.now = 0.0
        spec = scheduler_config.speculative_config
        self.spec = SpecDecodeScheduler(spec) if spec is not None else None

    # ------------------------------------------------------------------ requests in and out
    @property
    def num_waiting_for_streaming_input(self) -> int:
        return len(self.sessions.idle)

    def add_request(self, request: Request) -> None:
        existing = self.requests.get(request.request_id)
        if existing is not None:
            self.sessions.add_chunk(existing, request)
            return
        if CHECK_REQUESTS:  # the front validated it; asserted under SLOTSERVE_CHECK
            check_new_request(request)
        reason = self.kv_cache_manager.unfittable_reason(request.num_tokens)
        if reason is not None:  # refused (a session's first chunk: the session with it)
            request.status = RequestStatus.FINISHED_IGNORED
            self.report_end(request, "length", reason, session_end=FinishReason.REFUSED)
            return
        self.requests[request.request_id] = request
        if request.client is not None:
            self.live_clients[request.client] = self.live_clients.get(request.client, 0) + 1
        self.sessions.start(request)
        if request.structured_output_request is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[request.request_id] = request
            self._admit_grammars()
        else:
            self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> None:
        assert RequestStatus.is_finished(finished_status), finished_status
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        from_waiting = []
        for req_id in request_ids:
            r = self.requests.get(req_id)
            if r is None or r.is_finished():
                continue
            if r.status == RUNNING:
                self.running.remove(r)
            elif r.status == RequestStatus.WAITING_FOR_GRAMMAR:
                del self.waiting_for_grammar[req_id]
            elif r.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
                from_waiting.append(r)
            r.status = finished_status
            self._free_request(r)
        if from_waiting:
            self.waiting.remove_requests(from_waiting)

    def _free_request(self, request: Request, kv_written: bool = False) -> None:
        """`kv_written`: the request's K/V is known to be valid although it ends with an
        error (its grammar failed after a successful step), so its blocks stay cached."""
        req_id = request.request_id
        if request.status == RequestStatus.FINISHED_ERROR and not kv_written:
            # Blocks were cached when scheduled; after a failed step their K/V is garbage.
            self.kv_cache_manager.uncache_blocks(request)
        self.kv_cache_manager.free(request)
        self.slot_ledger.release(req_id)
        self.lora_slots.release(req_id)
        self.finished_req_ids.add(req_id)
        del self.requests[req_id]
        if request.client is not None:
            left = self.live_clients.pop(request.client) - 1
            if left:
                self.live_clients[request.client] = left
        self.sessions.forget(req_id)
        if self.spec is not None:
            self.spec.forget(request)

    def _end_request(self, request: Request, status: RequestStatus, message: str | None,
                     rejected: bool = False, session_end: FinishReason | None = None) -> None:
        """End a request outside update_from_output (refused, an idle session's end or
        timeout, outgrown, a failed grammar): free it, report its end (and a session's)."""
        request.status = status
        self._free_request(request)
        self.report_end(request, request.get_finished_reason(), message, rejected,
                        session_end=session_end)

    def report_end(self, request: Request | str, finish_reason: str | None,
                   message: str | None, rejected: bool = False, *, chunk: int = 0,
                   session_end: FinishReason | None = None, finished: bool = True) -> None:
        """Every output made outside a step (an end, an error, a refusal; not `finished`: a
        chunk refused, its session goes on), for the next update_from_output."""
        if isinstance(request, Request):
            chunk, session_end = request.chunk, session_end if request.resumable else None
            request = request.request_id
        self.pending_outputs.append(EngineCoreOutput(
            request, [], finish_reason, finished=finished, finish_message=message,
            rejected=rejected, chunk=chunk, chunk_done=not finished, session_end=session_end))

    def _admit_grammars(self) -> None:
        """Requests whose grammar is ready join the queue; a failed one is refused."""
        for r in list(self.waiting_for_grammar.values()):
            assert r.structured_output_request is not None
            grammar = r.structured_output_request.grammar
            if not grammar.is_ready():
                continue
            del self.waiting_for_grammar[r.request_id]
            if grammar.error is not None:
                self._end_request(r, RequestStatus.FINISHED_ERROR, grammar.error, True,
                                  FinishReason.REFUSED)
            else:
                r.status = RequestStatus.WAITING
                self.waiting.add_request(r)

    def _preempt_request(self, request: Request) -> None:
        """Recompute-style preemption; the caller has removed request from running."""
        self._reclaim_kv(request)
        request.status = PREEMPTED
        self.waiting.prepend_request(request)

    def _reclaim_kv(self, request: Request) -> None:
        """Take the KV (and slot) of a request that holds them while not running."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.slot_ledger.release(request.request_id)
        self.lora_slots.release(request.request_id)
        self.preempted_req_ids.add(request.request_id)

    def _reclaim_idle_slot(self, session: Request) -> None:
        """An idle session gives up slot and KV (past its grace period while a request waits,
        or over the idle cap); it keeps its tokens and recomputes them later."""
        self._reclaim_kv(session)
        self.sessions.num_slots_reclaimed += 1

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests:
            # Tail first, each prepended: re-admission comes back in the original order.
            while self.running:
                self._preempt_request(self.running.pop())
            # Paused and resumed sessions hold KV too; vLLM 0.33 raises here instead.
            for r in self._idle_kv_holders():
                self._reclaim_kv(r)
        ok = self.kv_cache_manager.reset_prefix_cache()
        if not ok and reset_running_requests:
            raise RuntimeError("KV blocks still in use after preempting every request")
        return ok

    def _idle_kv_holders(self) -> list[Request]:
        return self.sessions.kv_holders()

    # ------------------------------------------------------------------------- schedule
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """One step's output. `now` is the engine's clock (monotonic seconds); idle sessions
        time out against it. Without it, time stands still (callers with no sessions)."""
        if now is not None:
            self.now = now
        if self.waiting_for_grammar:
            self._admit_grammars()
        sessions = self.sessions
        if sessions.idle:
            sessions.expire(self.now)
            for r in sessions.over_cap(self.slot_ledger.holds):
                self._reclaim_idle_slot(r)
        kv = self.kv_cache_manager
        budget = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        new_blocks_of: dict[str, list[KVCacheBlock]] = {}
        preempted = False

        if self.waiting and fair_queue(self) is not None:
            victim = fair_victim(self)
            if victim is not None:
                self.running.remove(victim)
                self._preempt_request(victim)

        # Phase A: running requests, in admission order.
        running = self.running
        priority = self.policy == "priority"
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.num_tokens - r.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, max_model_len - r.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            if self.spec is not None and r.num_tokens - r.num_computed_tokens == 1:
                # Drafts count against the budget and max_model_len (propose caps them).
                n += len(self.spec.propose(r, budget - 1, max_model_len, len(running)))
            while True:
                new_blocks = kv.allocate_slots(r, n)
                if new_blocks is not None:
                    break
                if n > 1 and self.spec is not None and self.spec.unpropose(r.request_id):
                    n = 1  # no room for the drafts: give them up before preempting anyone
                    continue
                if priority:
                    victim = max(running, key=_priority_key)
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:
                        i -= 1
                    if victim.request_id in num_scheduled:
                        # Roll back what this step already gave the victim.
                        budget += num_scheduled.pop(victim.request_id)
                        del new_blocks_of[victim.request_id]
                        scheduled_running.remove(victim)
                else:
                    victim = running.pop()
                if victim is r and kv.holds_whole_cache(r.request_id):
                    self._end_outgrown(r)
                else:
                    self._preempt_request(victim)
                    preempted = True
                if victim is r:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(r)
            num_scheduled[r.request_id] = n
            new_blocks_of[r.request_id] = new_blocks
            budget -= n
            i += 1

        # Phase B: waiting requests, only if nobody was preempted this step.
        scheduled_new: list[Request] = []
        if not preempted and self.waiting and budget > 0:
            budget, blocked = self._schedule_waiting(budget, num_scheduled, scheduled_new)
            # Liveness: nothing can run because idle requests hold the KV cache. Reclaim the
            # KV of the least important, most recent holder other than the blocked head
            # (reclaiming the head's own KV cannot help it); reported as a preemption.
            while blocked is not None and not num_scheduled and not self.running:
                holders = [r for r in self._idle_kv_holders() if r is not blocked]
                if not holders:
                    break
                self._reclaim_kv(max(holders, key=_priority_key))
                budget, blocked = self._schedule_waiting(budget, num_scheduled, scheduled_new)

        return build_output(self, scheduled_new, scheduled_running, num_scheduled, new_blocks_of)

    def _end_outgrown(self, r: Request) -> None:
        self._end_request(r, RequestStatus.FINISHED_LENGTH_CAPPED, "the sequence outgrew "
                          "the whole KV cache", False, FinishReason.LENGTH)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          scheduled_new: list[Request]) -> tuple[int, Request | None]:
        """Admit waiting requests; also returns the request that a KV shortage blocked."""
        kv = self.kv_cache_manager
        ledger = self.slot_ledger
        waiting = self.waiting
        threshold = self.scheduler_config.long_prefill_token_threshold
        chunked = self.scheduler_config.enable_chunked_prefill
        passed_over: list[Request] = []
        kv_blocked: Request | None = None
        # Slot holders not in running: idle sessions and waiting (promoted) ones.
        idle_holders = (len(ledger.holders) - len(ledger.releasing)
                        - (len(self.running) - len(scheduled_new)))
        idle_session_holders = sum(1 for rid in self.sessions.idle if ledger.holds(rid))
        waiting_holders = idle_holders - idle_session_holders
        # Once a request waits for an adapter slot, later ones may not take a slot or join a
        # loaded adapter (its users must drain): base-model requests still go.
        new_adapters = True
        fair = fair_queue(self)
        held = slots_by_client(self.running, self.sessions.idle.values(), ledger) if fair else {}
        key = fair_key(held, ledger.holds)
        while waiting and budget > 0:
            if fair is not None:
                fair.bring_forward(key)  # fairness.py
            r = waiting.peek_request()
            holds_slot = ledger.holds(r.request_id)
            if not holds_slot and ledger.num_free_slots() <= 0:
                # An idle session past its grace period, or one that paused after r began to
                # wait, gives its slot to r (the seed's semantics otherwise: a session that
                # has just paused keeps it against a newcomer).
                victim = (self.sessions.slot_for_waiting(self.now, ledger.holds, r)
                          if self.sessions.idle else None)
                if victim is not None:
                    self._reclaim_idle_slot(victim)
                elif waiting_holders <= 0:
                    break
                else:
                    # Pass over it: a later request that already holds a slot may still go.
                    passed_over.append(waiting.pop_request())
                    continue
            if not self.lora_slots.can_acquire(r.request_id, r.lora_request, new_adapters):
                # An idle session past its grace may give its adapter slot up (r asks again).
                if not (new_adapters and self.lora_slots.reclaim_idle(
                        self.sessions, self.now, self._reclaim_idle_slot)):
                    new_adapters = False
                    passed_over.append(waiting.pop_request())
                continue
            if r.num_computed_tokens == 0:
                hit_blocks, n_hit = kv.get_computed_blocks(r)
            else:
                # A resumed session keeps its KV: no prefix lookup, its own count stands.
                hit_blocks, n_hit = [], 0
            computed = r.num_computed_tokens + n_hit
            n = r.num_tokens - computed
            if 0 < threshold < n:
                n = threshold
            if not chunked and n > budget:
                break
            n = min(n, budget)
            new_blocks = kv.allocate_slots(r, n, n_hit, hit_blocks, full_sequence_must_fit=True)
            if new_blocks is None:
                if kv.unfittable_reason(r.num_tokens) is not None:
                    # It grew (a late output after preemption) past what the whole cache
                    # holds: it can never run again, and must not block the queue.
                    waiting.pop_request()
                    self._end_outgrown(r)
                    continue
                kv_blocked = r
                break
            waiting.pop_request()
            if holds_slot:
                waiting_holders -= 1
            elif fair is not None:
                held[r.client] = held.get(r.client, 0) + 1
            ledger.claim(r.request_id)
            self.lora_slots.acquire(r.request_id, r.lora_request)
            self.running.append(r)
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = n_hit
            r.status = RUNNING
            r.num_computed_tokens = computed
            scheduled_new.append(r)
            num_scheduled[r.request_id] = n
            budget -= n
        for r in reversed(passed_over):
            waiting.prepend_request(r)
        return budget, kv_blocked

    # ------------------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput,
                           now: float | None = None) -> list[EngineCoreOutput]:
        """Apply the model's answer to an output. `now`, as for schedule(), is when a session
        that stops here goes idle."""
        if now is not None:
            self.now = now
        if model_runner_output.failed:
            self._fail_requests(model_runner_output.failed)
        outputs = self.pending_outputs
        self.pending_outputs = []
        if self.spec is not None:
            self.spec.step_done(self.now)
        sampled = model_runner_output.sampled_token_ids
        index_of = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        requests = self.requests
        max_model_len = self.max_model_len
        for req_id in scheduler_output.num_scheduled_tokens:
            r = requests.get(req_id)
            if r is None:
                continue  # finished (e.g. aborted) while the step ran
            status = r.status
            if status != RUNNING and status != PREEMPTED:
                continue  # a stale output for a session that has moved on
            i = index_of.get(req_id)
            if i is None:
                continue
            generated = sampled[i]
            if not generated:
                continue  # a partial prefill samples nothing
            n_new, stopped, message, refusal = append_generated(r, generated, max_model_len)
            if self.spec is not None:  # counts acceptance, rolls rejected drafts back
                self.spec.on_output(r, scheduler_output, generated, status == RUNNING)
            new_tokens = generated if n_new == len(generated) else generated[:n_new]
            lp = logprobs[i] if logprobs is not None else None
            if lp is not None:
                lp = lp[:n_new]
            if not stopped:
                outputs.append(EngineCoreOutput(req_id, new_tokens, None, None, lp,
                                                r.num_cached_tokens, chunk=r.chunk))
                continue
            finish_reason = r.get_finished_reason()
            stop_reason = r.stop_reason
            if status == RUNNING:
                self.running.remove(r)
            else:
                self.waiting.remove_request(r)
            chunk = r.chunk  # a queued chunk may be folded in at once (on_stop)
            # A failed grammar ends a session too: its next chunk could not be constrained.
            finished = message is not None or self.sessions.on_stop(r, self.now)
            if finished:
                # A failed grammar (message) ends the request with an error, but the step ran:
                # the K/V its blocks hold is valid and other requests may share it.
                self._free_request(r, kv_written=message is not None)
            session_end = (None if not (finished and r.resumable) else FinishReason.END
                           if message is None else FinishReason.ERROR)
            outputs.append(EngineCoreOutput(req_id, new_tokens, finish_reason, stop_reason, lp,
                                            r.num_cached_tokens, finished, message,
                                            refusal is not None, chunk=chunk,
                                            chunk_done=r.resumable, session_end=session_end,
                                            error_code=refusal))
        return outputs

    def _fail_requests(self, failed: dict[str, str]) -> None:
        """The worker could not run these requests (and ran the rest of the step): they end
        with an error, their blocks' hashes dropped (their K/V may never have been written)."""
        for req_id, message in failed.items():
            r = self.requests.get(req_id)
            if r is None or r.status not in (RUNNING, PREEMPTED):
                continue  # finished meanwhile, or a session that has moved on
            self.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            self.report_end(r, FinishReason.ERROR.value, message, session_end=FinishReason.ERROR)

    # -------------------------------------------------------------------------- queries
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)  # idle sessions do not count (vLLM)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running or self.finished_req_ids
                    or self.preempted_req_ids or self.pending_outputs)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def make_stats(self) -> SchedulerStats:
        return make_stats(self)


def _priority_key(r: Request) -> tuple[int, float]:
    # The worst request: the largest priority value, then the latest arrival.
    return (r.priority, r.arrival_time)
