"""The event vocabulary that drives a scheduler in checks, shared by the fuzzer and the explorer.

Each event is a frozen record whose `apply` changes a `Harness` (slotserve.check.harness: the
scheduler with a checker, the worker's slot table, in-flight outputs, open sessions and a
clock) through the scheduler's public calls only, and whose `choices` enumerates the instances
the explorer tries from a `Menu`. Adding an event is one class here plus its entry in
`EVENT_TYPES` (and a rule in the fuzzer, which builds the same classes from its own
strategies). Every idle duration the scheduler compares is an entry in `idle_thresholds` (the
session timeout, and issue 11's grace period after which a waiting request may take an idle
session's slot): `Tick` jumps past each, and the canonical state keeps idle times up to the
longest.

Events name requests by position, never by id (`Abort(0)` aborts the oldest live request), so
the same event means the same thing in every state that is equal up to renaming of ids.

Time: the harness's clock `now` moves only by `Tick` (a whole-second jump past an idle
threshold) and by a negligible drift per event (so arrival times stay distinct and ordered).
The harness hands it to the scheduler with every schedule(), as the engine hands its clock,
so a timeout happens at a chosen event and a recorded trace reproduces it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from slotserve.check.grammar import CountingGrammar
from slotserve.core.request import Request, RequestStatus
from slotserve.core.structured_output import StructuredOutputRequest
from slotserve.errors import InvariantViolation
from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slotserve.check.harness import Harness
    from slotserve.core.scheduler import Scheduler

EOS = 2
STOP = 7
TOKEN = 1  # the regular token the explorer's model samples (in its prompt alphabet)

RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED


@dataclass(frozen=True, slots=True)
class Menu:
    """What the explorer may choose at each step; small sets keep the state space finite."""

    prompts: tuple[tuple[int, ...], ...] = ((1, 3, 1, 3),)
    chunks: tuple[tuple[int, ...], ...] = ((3,),)
    max_tokens: tuple[int, ...] = (2,)
    priorities: tuple[int, ...] = (0,)
    sessions: bool = False
    outcomes: tuple[int, ...] = (TOKEN, STOP)
    failures: bool = False
    # A step whose worker isolated a failure to one request (FailRequest).
    request_failures: bool = False
    resets: bool = True
    aborts: bool = True
    ticks: bool = False
    max_live_requests: int = 3
    max_in_flight: int = 2
    # Adapter ids a new request may use (0: the base model); see ExploreConfig.max_loras.
    loras: tuple[int, ...] = (0,)


class Event(Protocol):
    def apply(self, h: Harness) -> None: ...


@functools.lru_cache(maxsize=256)
def _params(max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False) -> SamplingParams:
    # Shared between requests: nothing downstream of add_request mutates params.
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP],
                          min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos)


@functools.lru_cache(maxsize=64)
def _lora(lora_id: int) -> LoRARequest | None:
    return LoRARequest(f"lora{lora_id}", lora_id, f"/explorer/lora{lora_id}") if lora_id else None


@dataclass(frozen=True, slots=True)
class Arrive:
    """A new request (a streaming session's first chunk when resumable)."""

    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    resumable: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    # > 0: under a grammar (check.grammar.CountingGrammar) complete after this many tokens.
    grammar: int = 0
    lora: int = 0  # > 0: the adapter with this id
    client: int = 0  # > 0: a named client (the scheduler is then fair among clients)

    def apply(self, h: Harness) -> None:
        rid = h.new_request_id()
        sor = (StructuredOutputRequest(CountingGrammar(self.grammar)) if self.grammar
               else None)
        h.observer.add_request(Request(
            rid, list(self.prompt),
            _params(self.max_tokens, 0 if self.grammar else self.min_tokens, self.ignore_eos),
            eos_token_id=EOS, priority=self.priority, arrival_time=h.now,
            resumable=self.resumable, structured_output_request=sor,
            lora_request=_lora(self.lora), client=f"c{self.client}" if self.client else None))
        if self.resumable and rid in h.sched.requests:
            h.open_sessions.append(rid)

    def __str__(self) -> str:
        extra = "".join([f" priority={self.priority}" if self.priority else "",
                         f" min_tokens={self.min_tokens}" if self.min_tokens else "",
                         " ignore_eos" if self.ignore_eos else "",
                         f" grammar={self.grammar}" if self.grammar else "",
                         f" lora={self.lora}" if self.lora else "",
                         f" client={self.client}" if self.client else "",
                         " (a session)" if self.resumable else ""])
        return f"arrive {list(self.prompt)} max_tokens={self.max_tokens}{extra}"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Arrive]:
        if len(h.sched.requests) >= m.max_live_requests:
            return
        for prompt, max_tokens, prio, lora in itertools.product(m.prompts, m.max_tokens,
                                                                m.priorities, m.loras):
            yield cls(prompt, max_tokens, prio, lora=lora)
            if m.sessions:
                yield cls(prompt, max_tokens, prio, resumable=True, lora=lora)


@dataclass(frozen=True, slots=True)
class Chunk:
    """The next input chunk of the session-th open session (empty: a zero-token continuation)."""

    session: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0

    def apply(self, h: Harness) -> None:
        rid = h.open_sessions[self.session]
        h.observer.add_request(Request(rid, list(self.prompt), _params(self.max_tokens),
                                       eos_token_id=EOS, priority=self.priority,
                                       arrival_time=h.now, resumable=True))

    def __str__(self) -> str:
        return (f"chunk {list(self.prompt)} max_tokens={self.max_tokens} to open session "
                f"#{self.session}")

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Chunk]:
        for k, rid in enumerate(h.open_sessions):
            r = h.sched.requests[rid]
            if h.sched.sessions.queued.get(rid):
                continue  # one queued chunk per session is enough to cover the queue path
            for prompt, max_tokens in itertools.product(m.chunks, m.max_tokens):
                yield cls(k, prompt, max_tokens, r.priority)


@dataclass(frozen=True, slots=True)
class EndSession:
    """The client ends the session-th open session (a non-resumable request with its id)."""

    session: int

    def apply(self, h: Harness) -> None:
        rid = h.open_sessions.pop(self.session)
        h.observer.add_request(Request(rid, [0], _params(1), eos_token_id=EOS, arrival_time=h.now))

    def __str__(self) -> str:
        return f"end open session #{self.session}"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[EndSession]:
        for k in range(len(h.open_sessions)):
            yield cls(k)


@dataclass(frozen=True, slots=True)
class Abort:
    """The client aborts the index-th live request (in arrival order)."""

    index: int

    def apply(self, h: Harness) -> None:
        rid = h.live_ids()[self.index]
        if rid in h.open_sessions:
            h.open_sessions.remove(rid)
        h.observer.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def __str__(self) -> str:
        return f"abort live request #{self.index}"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Abort]:
        if m.aborts:
            for k in range(len(h.sched.requests)):
                yield cls(k)


@dataclass(frozen=True, slots=True)
class Reset:
    """reset_prefix_cache(reset_running_requests=running)."""

    running: bool

    def apply(self, h: Harness) -> None:
        if self.running and h.sched.running:
            h.effects.add("reset with running requests")
        ok = h.observer.reset_prefix_cache(self.running)
        if self.running and not ok:
            raise InvariantViolation("[reset] blocks still in use after resetting every request")

    def __str__(self) -> str:
        return f"reset_prefix_cache(reset_running_requests={self.running})"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Reset]:
        if not m.resets:
            return
        s = h.sched
        pool = s.kv_cache_manager.block_pool
        all_free = pool.get_num_free_blocks() == pool.num_usable_blocks
        # Without running requests or blocks in use a reset only drops the hash map: skip the
        # no-ops (they merge into the same state anyway).
        if pool.cached_block_hash_to_block and all_free:
            yield cls(False)
        if s.running or not all_free or pool.cached_block_hash_to_block:
            yield cls(True)


@dataclass(frozen=True, slots=True)
class Schedule:
    """schedule(); the output goes to the checker and the worker's slot table, and waits
    in flight for the model (an async engine schedules again before it answers)."""

    def apply(self, h: Harness) -> None:
        h.schedule()

    def __str__(self) -> str:
        return "schedule"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Schedule]:
        # EngineCore steps only with requests, pending releases or idle sessions.
        if len(h.in_flight) < m.max_in_flight and (h.sched.has_requests()
                                                   or h.sched.sessions.idle):
            yield cls()


@dataclass(frozen=True, slots=True)
class Update:
    """The model answers the oldest in-flight output: sampled[i] for its i-th sampler."""

    sampled: tuple[tuple[int, ...], ...]

    def apply(self, h: Harness) -> None:
        h.update(self.sampled)

    def __str__(self) -> str:
        names = ["stop" if t == (STOP,) else "eos" if t == (EOS,) else str(list(t))
                 for t in self.sampled]
        return "model answers" + (": " + ", ".join(names) if names else " (nothing sampled)")

    @classmethod
    def plain(cls, h: Harness) -> Update:
        return cls(((TOKEN,),) * len(h.in_flight[0][1]))

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Update]:
        if not h.in_flight:
            return
        requests = h.sched.requests
        out, samplers = h.in_flight[0]
        drafts = out.scheduled_spec_decode_tokens
        per_request = []
        for rid in samplers:
            r = requests.get(rid)
            # A request that is gone ignores its token: one outcome is enough.
            live = r is not None and r.status in (RUNNING, PREEMPTED)
            # A request verifying drafts accepts 0..k of them, then samples one token.
            d = tuple(drafts.get(rid, ())) if live else ()
            per_request.append([d[:a] + (t,) for a in range(len(d) + 1) for t in m.outcomes]
                               if live else [(TOKEN,)])
        for sampled in itertools.product(*per_request):
            yield cls(tuple(sampled))


@dataclass(frozen=True, slots=True)
class FailStep:
    """The model step of the oldest in-flight output raises as a whole (the worker could not
    isolate it); all its requests end with an error."""

    def apply(self, h: Harness) -> None:
        h.effects.add("failed step")
        h.fail_step()

    def __str__(self) -> str:
        return "model step fails"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[FailStep]:
        if m.failures and h.in_flight:
            yield cls()


@dataclass(frozen=True, slots=True)
class FailRequest:
    """The worker answers the oldest in-flight output but could not run its index-th
    scheduled request (it isolated a failure to it); every other sampler gets a token."""

    index: int

    def apply(self, h: Harness) -> None:
        out, samplers = h.in_flight[0]
        rid = list(out.num_scheduled_tokens)[self.index]
        r = h.sched.requests.get(rid)
        if r is not None and r.status in (RUNNING, PREEMPTED):
            h.effects.add("one request of a step failed")
        h.update([(TOKEN,)] * len(samplers), failed=rid)

    def __str__(self) -> str:
        return f"model answers, but scheduled request #{self.index} failed alone"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[FailRequest]:
        if m.request_failures and h.in_flight:
            for k in range(len(h.in_flight[0][0].num_scheduled_tokens)):
                yield cls(k)


def idle_thresholds(sched: Scheduler) -> tuple[float, ...]:
    """The idle durations the scheduler compares an idle session's idle time against: the
    jumps `Tick` makes, and what the canonical state keeps of idle times."""
    config = sched.scheduler_config
    return (config.idle_slot_grace_s, config.streaming_session_timeout_s)


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock jumps by `seconds` (the explorer: just past an idle threshold)."""

    seconds: float

    def apply(self, h: Harness) -> None:
        h.now += self.seconds

    def __str__(self) -> str:
        return f"clock +{self.seconds:g} s"

    @classmethod
    def choices(cls, h: Harness, m: Menu) -> Iterator[Tick]:
        sessions = h.sched.sessions
        if not m.ticks or not sessions.idle:
            return
        idle = [h.now - since for since in sessions.idle_since.values()]
        for t in idle_thresholds(h.sched):
            # A jump matters only while some idle session has not yet been idle past t.
            if min(idle) <= t:
                yield cls(float(math.ceil(t)) + 1.0)


class EventType(Protocol):
    def choices(self, h: Harness, m: Menu) -> Iterator[Event]: ...


# The order is the order the explorer tries events in each state.
EVENT_TYPES: tuple[EventType, ...] = (Update, Schedule, Arrive, Chunk, EndSession, Abort, Reset,
                                      FailStep, FailRequest, Tick)


def enabled_events(h: Harness, menu: Menu) -> list[Event]:
    return [e for t in EVENT_TYPES for e in t.choices(h, menu)]

