"""A scheduler plus everything a client and a worker hold around it, for the checks.

`Harness` holds the invariant checker, the worker's real `RequestSlots` table, the outputs
scheduled but not yet answered by the model (several may be in flight, so pipelined steps
interleave with other events), the sessions the client may still send chunks to, and a logical
clock `now`, which it hands the scheduler (and a trace) with every schedule(). `apply(event)`
runs one event of slotserve.check.events and checks the invariants after it; `drain()` is the
liveness check: end every session, answer with tokens, step until nothing is held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slotserve.check.checker import InvariantChecker
from slotserve.check.events import PREEMPTED, RUNNING, EndSession, Schedule, Update
from slotserve.check.observer import SchedulerObserver
from slotserve.check.trace import TraceRecorder
from slotserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from slotserve.core.request import RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.errors import InvariantViolation
from slotserve.worker.slots import RequestSlots

if TYPE_CHECKING:
    from slotserve.check.events import Event

# Clock drift per event: far below the 1 s expiry-check interval over any depth we explore.
EPS = 1e-6

IDLE = RequestStatus.WAITING_FOR_STREAMING_REQ


@dataclass(slots=True)
class Harness:
    sched: Scheduler
    recorder: TraceRecorder | None = None
    checker: InvariantChecker = field(init=False)
    # The scheduler's state-changing calls, recorded (with a recorder) and checked.
    observer: SchedulerObserver = field(init=False)
    slots: RequestSlots = field(init=False)
    # Scheduled outputs the model has not answered, oldest first, each with the ids whose
    # prefill completes in it (the ones that sample, decided when it was scheduled).
    in_flight: list[tuple[SchedulerOutput, tuple[str, ...]]] = field(default_factory=list)
    open_sessions: list[str] = field(default_factory=list)
    next_seq: int = 0
    now: float = 0.0
    # What the last event did that is worth reaching (the explorer's states of interest).
    effects: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.checker = InvariantChecker(self.sched, full_block_scan_every=1)
        self.observer = SchedulerObserver(self.sched, self.checker, self.recorder)
        self.slots = RequestSlots(self.sched.max_num_running_reqs)

    # ------------------------------------------------------------------ driving
    def apply(self, event: Event) -> None:
        self.effects = set()
        self.now += EPS
        hits = self.sched.kv_cache_manager.prefix_cache_stats.hits
        event.apply(self)
        if self.sched.kv_cache_manager.prefix_cache_stats.hits > hits:
            self.effects.add("prefix hit")
        requests = self.sched.requests
        self.open_sessions = [s for s in self.open_sessions if s in requests]
        self.check_invariants()

    def check_invariants(self) -> None:
        s = self.sched
        if not all(r.status == RUNNING for r in s.running):
            raise InvariantViolation(f"[state] running holds a request that is not RUNNING: "
                                     f"{s.running}")
        idle = s.sessions.idle
        if not all(r.status == IDLE for r in idle.values()):
            raise InvariantViolation(f"[state] the idle sessions hold a request that is not "
                                     f"idle: {list(idle.values())}")
        queues = len(s.running) + len(s.waiting) + len(idle) + len(s.waiting_for_grammar)
        if queues != len(s.requests):
            raise InvariantViolation(f"[state] running, waiting, idle and compiling hold "
                                     f"{queues} requests, not {len(s.requests)}")
        self.checker.check_blocks()
        self.checker.check_grammars()
        if any(rid in s.slot_ledger.holders for rid in idle):
            self.effects.add("idle session holds a slot")

    def new_request_id(self) -> str:
        self.next_seq += 1
        return f"r{self.next_seq}"

    def live_ids(self) -> list[str]:
        return list(self.sched.requests)  # insertion order is arrival order (ids are fresh)

    def schedule(self) -> SchedulerOutput:
        s = self.sched
        running = list(s.running)
        holds = s.kv_cache_manager.holds_blocks
        idle_kv = [rid for rid, r in s.requests.items() if r.status != RUNNING and holds(rid)]
        idle = list(s.sessions.idle)
        reclaimed = s.sessions.num_slots_reclaimed
        out = self.observer.schedule(now=self.now)
        released = out.released_req_ids
        for new in out.scheduled_new_reqs:
            if new.req_id in self.slots and new.req_id not in released:
                self.effects.add("resumed session keeps its slot")
        self.slots.apply(out)
        self.checker.check_worker_slots(self.slots)
        requests = s.requests
        samplers = tuple(rid for rid in out.num_scheduled_tokens
                         if requests[rid].num_computed_tokens >= requests[rid].num_tokens)
        self.in_flight.append((out, samplers))
        if out.scheduled_spec_decode_tokens:
            self.effects.add("drafts proposed")
        if any(r.status == PREEMPTED for r in running):
            self.effects.add("preemption")
            if out.scheduled_spec_decode_tokens:
                self.effects.add("preemption in a step with drafts")
        if any(rid in requests and not holds(rid) for rid in idle_kv):
            self.effects.add("idle KV reclaimed")
        if any(rid not in requests for rid in idle):
            self.effects.add("idle session timed out")
        if s.sessions.num_slots_reclaimed > reclaimed:
            # Past its grace period (or over the cap), an idle session gave up its slot.
            self.effects.add("idle session's slot taken")
        if len(self.slots) == self.slots.max_num_reqs and s.waiting:
            self.effects.add("all slots held, a request waits")
        return out

    def update(self, sampled: Sequence[Sequence[int]], failed: str | None = None) -> None:
        """Answer the oldest in-flight output: sampled[i] for its i-th sampling request;
        `failed` names a scheduled request the worker could not run (it samples nothing)."""
        out, samplers = self.in_flight.pop(0)
        if len(sampled) != len(samplers):
            raise ValueError(f"{len(samplers)} requests sample in this step, got {len(sampled)}")
        tokens = dict(zip(samplers, sampled, strict=True))
        for rid, d in out.scheduled_spec_decode_tokens.items():
            n = len(tokens.get(rid, ()))
            if n:
                self.effects.add("all drafts accepted" if n == len(d) + 1
                                 else "a draft rejected")
        ids = [r for r in out.num_scheduled_tokens if r != failed]
        requests = self.sched.requests
        for rid in samplers:
            r = requests.get(rid)
            if r is not None and r.status == PREEMPTED:
                self.effects.add("token after preemption")
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[list(tokens.get(r, ())) for r in ids],
                                failed=None if failed is None else {failed: "injected"})
        idle = len(self.sched.sessions.idle)
        for o in self.observer.update_from_output(out, mro, now=self.now):
            if o.finished and o.request_id in self.open_sessions:
                self.open_sessions.remove(o.request_id)
        if len(self.sched.sessions.idle) > idle:
            self.effects.add("session went idle")

    def fail_step(self) -> None:
        """The model step of the oldest in-flight output raised: EngineCore._fail_step."""
        out, _ = self.in_flight.pop(0)
        self.observer.finish_requests(list(out.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)

    # ------------------------------------------------------------------ draining
    def drain(self, max_steps: int, known: Callable[[Harness], int | None] | None = None,
              log: list[Event] | None = None) -> int:
        """End every open session, answer every output with a plain token, and step until
        nothing is left; then nothing may be held. Raises Wedge past max_steps or on a leak.

        `known(h)` may return how many more steps a state is already known to need (the
        explorer's memo); the drain stops there. Applied events are appended to `log`.
        Returns the steps taken (schedule + answer pairs)."""
        def move(event: Event) -> None:
            if log is not None:
                log.append(event)
            self.apply(event)

        for _ in range(len(self.open_sessions)):
            move(EndSession(0))
        while self.in_flight:
            move(Update.plain(self))
        steps = 0
        s = self.sched
        while s.has_requests() or s.sessions.idle:
            if known is not None and (rest := known(self)) is not None:
                steps += rest
                break
            if steps == max_steps:
                raise Wedge(
                    f"[wedge] not drained after {max_steps} steps with every session ended "
                    f"and the model sampling: running {s.running}, waiting {list(s.waiting)}, "
                    f"idle {list(s.sessions.idle.values())}, slots {sorted(self.slots.holders)}")
            move(Schedule())
            move(Update.plain(self))
            steps += 1
        else:
            try:
                self.checker.assert_drained()
            except InvariantViolation as exc:
                raise Wedge(str(exc)) from exc
            if len(self.slots):
                raise Wedge(f"[leak] worker slots still held: {sorted(self.slots.holders)}")
        if steps > max_steps:
            raise Wedge(f"[wedge] not drained after {max_steps} steps with every session "
                        f"ended and the model sampling (it needs {steps})")
        return steps


class Wedge(InvariantViolation):
    """A state that draining cannot empty: requests left, or blocks or slots still held."""
