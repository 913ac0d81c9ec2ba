"""Admission control for completions and chat (issue 11, item 6).

A request is *waiting* from the moment it is accepted until it produces its first output: in
the front's queue here, or in the engine before its first token. Two bounds hold over waiting
requests, on sequences (prompts x n) and on tokens (each sequence's prompt plus max_tokens:
the work it can still queue); a request that would pass either gets 429 with a Retry-After
estimated from how fast waiting sequences have been starting. One client may hold at most a
share of either bound, so its burst is refused before it fills the queue for everyone else;
a request larger than that share by itself is refused with 400 (it could never fit). When
several heavy clients fill the room, a light one (holding less than an equal split) may still
overfill it, up to twice the bounds.

Fairness: accepted requests wait here in one queue per client and go to the engine round-robin
over clients, while the engine holds at most `core_window` sequences that have not started
(keeping it short keeps this order), except that a client with none of its own there goes
past that window (so one client's request that cannot start, e.g. 8 sequences waiting for
slots, holds back no other client's first token), and, while other clients queue, no client
holds more than its share of the engine's slots (work-conserving: a client alone may use them
all). So a client's first token waits for a slot that the burst of another
client frees, not behind that burst's queue. Two clients each at their share can still fill
every slot: the engine's queue is fair among clients too (core/fairness.py, from the key
`tag_client` puts on each core request), and preempts the client holding the most for one
holding at least two fewer.

A client is the request's `user` field (OpenAI's end-user id) when given, else the peer
address. A client that sends a different `user` with every request splits its own share;
the global bounds still hold.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from slotserve.entrypoints.openai.errors import APIError

if TYPE_CHECKING:
    from slotserve.engine.processor import ProcessedRequest

T = TypeVar("T")
# The window over which the rate at which waiting sequences start is measured.
RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60
MAX_CLIENT_KEY_CHARS = 256
# A client whose last request ended this recently still counts as active.
ACTIVE_LINGER_S = 1.0
# A client refused again within REFUSAL_MEMORY_S of its last refusal gets its 429 after
# TARPIT_S (refusal_delay).
REFUSAL_MEMORY_S, TARPIT_S = 1.0, 0.5
MAX_REMEMBERED_CLIENTS = 10_000


def default_bounds(max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int) -> tuple[int, int]:
    """Waiting sequences and tokens when not given: four batches' worth of sequences, and
    enough tokens for them at a full context each, or 32 steps' budget if that is more."""
    seqs = max(64, 4 * max_num_seqs)
    return seqs, max(seqs * max_model_len, 32 * max_num_batched_tokens)


@dataclass(slots=True, eq=False)
class Ticket:
    client: str
    num_seqs: int
    num_tokens: int
    released: asyncio.Future[None]
    # "queued" (here), "released" (sent to the engine, no output yet), "started" (producing:
    # no longer waiting), "done" (ended or abandoned).
    state: str = "queued"


@dataclass(slots=True)
class _Totals:
    seqs: int = 0
    tokens: int = 0


@dataclass(slots=True)
class AdmissionController:
    max_waiting_seqs: int
    max_waiting_tokens: int
    max_client_share: float
    # Sequences released to the engine that have produced nothing yet, at most (unless none).
    core_window: int
    # The engine's slots (max_num_seqs): while other clients queue, one client holds at most
    # its share of them.
    num_slots: int
    waiting: _Totals = field(default_factory=_Totals)
    by_client: dict[str, _Totals] = field(default_factory=dict)
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)
    # Clients with queued tickets, in round-robin order.
    turn: deque[str] = field(default_factory=deque)
    # Released sequences that have not started, and those not finished, per client.
    unstarted_by_client: dict[str, int] = field(default_factory=dict)
    in_engine: dict[str, int] = field(default_factory=dict)
    # When each client's last request ended: it still counts as active for a moment (a
    # closed-loop client between two requests is not gone).
    last_done: dict[str, float] = field(default_factory=dict)
    started_times: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))
    num_refused: int = 0
    # When each client was last refused (a client that ignores Retry-After is answered
    # slowly: see refusal_delay).
    refused_at: dict[str, float] = field(default_factory=dict)

    @property
    def unstarted_seqs(self) -> int:
        """Released sequences that have not started (the window's count): few clients hold
        any, each at least one, within the bound on waiting sequences."""
        return sum(self.unstarted_by_client.values())

    @property
    def client_max_seqs(self) -> int:
        return max(1, int(self.max_client_share * self.max_waiting_seqs))

    @property
    def client_max_tokens(self) -> int:
        return max(1, int(self.max_client_share * self.max_waiting_tokens))

    @property
    def client_max_slots(self) -> int:
        return max(1, int(self.max_client_share * self.num_slots))

    def precheck(self, client: str) -> None:
        """A 429 before any work on the request (tokenizing it) when its client, or the
        server, has no room left even for one more sequence."""
        self._check_room(client, 1, 0)

    def _check_room(self, client: str, seqs: int, tokens: int) -> None:
        """The bounds: one client's share of the waiting room; and the room itself, which a
        client holding less than an equal split among the clients waiting may overfill up to
        twice (so two heavy clients at their share cannot lock a light one out)."""
        mine = self.by_client.get(client) or _Totals()
        self._check(client, mine.seqs + seqs, self.client_max_seqs, mine.tokens + tokens,
                    self.client_max_tokens, "this client")
        total_seqs, total_tokens = self.waiting.seqs + seqs, self.waiting.tokens + tokens
        if total_seqs <= self.max_waiting_seqs and total_tokens <= self.max_waiting_tokens:
            return
        clients = len(self.by_client) + (client not in self.by_client)
        light = (mine.seqs + seqs <= self.max_waiting_seqs // clients
                 and mine.tokens + tokens <= self.max_waiting_tokens // clients)
        factor = 2 if light else 1
        self._check(client, total_seqs, factor * self.max_waiting_seqs, total_tokens,
                    factor * self.max_waiting_tokens, "the server")

    def admit(self, client: str, num_seqs: int, num_tokens: int) -> Ticket:
        """Accept a request (queued until `wait` returns) or raise an APIError: 400 for a
        request that alone exceeds one client's share (it would never fit), else 429 past
        the bounds."""
        if num_seqs > self.client_max_seqs or num_tokens > self.client_max_tokens:
            raise APIError(
                400, f"this request asks for {num_seqs} sequences and {num_tokens} tokens of "
                f"work (prompt + max_tokens); one client may have at most "
                f"{self.client_max_seqs} sequences and {self.client_max_tokens} tokens waiting "
                "on this server: split it", param="n", code="request_too_large")
        self._check_room(client, num_seqs, num_tokens)
        ticket = Ticket(client, num_seqs, num_tokens, asyncio.get_running_loop().create_future())
        self._add(client, num_seqs, num_tokens)
        queue = self.queues.get(client)
        if queue is None:
            queue = self.queues[client] = deque()
            self.turn.append(client)
        queue.append(ticket)
        self._dispatch()
        return ticket

    async def wait(self, ticket: Ticket) -> bool:
        """Until it is this request's turn to go to the engine."""
        await asyncio.shield(ticket.released)
        return True

    def started(self, ticket: Ticket) -> None:
        """The request produced its first output: it waits no more (its sequences still hold
        engine slots until `finished`)."""
        if ticket.state == "released":
            left = self.unstarted_by_client[ticket.client] - ticket.num_seqs
            if left:
                self.unstarted_by_client[ticket.client] = left
            else:
                del self.unstarted_by_client[ticket.client]
            self.started_times.append((time.monotonic(), ticket.num_seqs))
            ticket.state = "started"
            self._add(ticket.client, -ticket.num_seqs, -ticket.num_tokens)
            self._dispatch()

    def finished(self, ticket: Ticket) -> None:
        """The request ended, or was abandoned (queued or not)."""
        if ticket.state == "done":
            return
        if ticket.state == "queued":
            queue = self.queues[ticket.client]
            queue.remove(ticket)
            if not queue:
                del self.queues[ticket.client]
                self.turn.remove(ticket.client)
            self._add(ticket.client, -ticket.num_seqs, -ticket.num_tokens)
            ticket.released.cancel()
        else:
            self.started(ticket)
            left = self.in_engine[ticket.client] - ticket.num_seqs
            if left:
                self.in_engine[ticket.client] = left
            else:
                del self.in_engine[ticket.client]
            self.last_done[ticket.client] = time.monotonic()
        ticket.state = "done"
        self._dispatch()

    async def track(self, ticket: Ticket, outputs: AsyncGenerator[T, None]
                    ) -> AsyncGenerator[T, None]:
        """`outputs`, marking the ticket started at the first one and finished at the end."""
        try:
            async for item in outputs:
                self.started(ticket)
                yield item
        finally:
            self.finished(ticket)
            await outputs.aclose()

    # ----- internals -----------------------------------------------------------------------

    def _add(self, client: str, seqs: int, tokens: int) -> None:
        self.waiting.seqs += seqs
        self.waiting.tokens += tokens
        mine = self.by_client.setdefault(client, _Totals())
        mine.seqs += seqs
        mine.tokens += tokens
        if mine.seqs == 0:
            del self.by_client[client]

    def _others_active(self, client: str) -> bool:
        """Whether a client other than `client` is queued, in the engine, or was within the
        last ACTIVE_LINGER_S."""
        if len(self.turn) > 1 or any(c != client for c in self.in_engine):
            return True
        now = time.monotonic()
        for c, t in list(self.last_done.items()):
            if now - t > ACTIVE_LINGER_S:
                del self.last_done[c]
            elif c != client:
                return True
        return False

    def _dispatch(self) -> None:
        """Release queued tickets round-robin over clients while the engine has room: few
        sequences waiting in it that have not started (a client with none of its own there
        goes past that window), and, while other clients are active, no client over its
        share of the slots (so theirs find a free slot rather than wait for one of its
        requests to end: there is no preemption between clients). A client alone may use
        every slot."""
        skipped = 0
        while self.turn and skipped < len(self.turn):
            client = self.turn[0]
            ticket = self.queues[client][0]
            held = self.in_engine.get(client, 0)
            if ((self.unstarted_seqs >= self.core_window
                 and self.unstarted_by_client.get(client, 0))
                    or (held and held + ticket.num_seqs > self.client_max_slots
                        and self._others_active(client))):
                # The window is full and it has a request there, or it is over its share
                # while others are active: the next client.
                self.turn.rotate(-1)
                skipped += 1
                continue
            skipped = 0
            self.turn.popleft()
            queue = self.queues[client]
            queue.popleft()
            if queue:
                self.turn.append(client)
            else:
                del self.queues[client]
            ticket.state = "released"
            self.unstarted_by_client[client] = (self.unstarted_by_client.get(client, 0)
                                                + ticket.num_seqs)
            self.in_engine[client] = held + ticket.num_seqs
            ticket.released.set_result(None)

    def refusal_delay(self, client: str) -> float:
        """How long to hold a 429 before sending it: nothing for a client's first refusal in a
        while, TARPIT_S when it asks again at once (a client that ignores Retry-After then
        costs the server a sleeping coroutine per request, not a parse and a response at
        full speed)."""
        now = time.monotonic()
        last = self.refused_at.get(client)
        self.refused_at[client] = now
        if len(self.refused_at) > MAX_REMEMBERED_CLIENTS:
            self.refused_at = {c: t for c, t in self.refused_at.items()
                               if now - t < REFUSAL_MEMORY_S}
        return TARPIT_S if last is not None and now - last < REFUSAL_MEMORY_S else 0.0

    def _check(self, client: str, seqs: int, max_seqs: int, tokens: int, max_tokens: int,
               who: str) -> None:
        if seqs <= max_seqs and tokens <= max_tokens:
            return
        self.num_refused += 1
        what = (f"{seqs} sequences (limit {max_seqs})" if seqs > max_seqs
                else f"{tokens} tokens (limit {max_tokens})")
        retry = self.retry_after()
        raise APIError(429, f"{who} has too much work waiting: accepting this request would "
                       f"make {what} waiting to start; retry after {retry} s",
                       code="too_many_requests", headers={"Retry-After": str(retry)})

    def retry_after(self) -> int:
        """Seconds until the waiting sequences have started, at the recent rate."""
        now = time.monotonic()
        recent = sum(n for t, n in self.started_times if now - t <= RATE_WINDOW_S)
        if not recent:
            return 1
        rate = recent / RATE_WINDOW_S
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.waiting.seqs / rate)))


def client_key(user: str | None, peer: str | None) -> str:
    if isinstance(user, str) and user:
        return "user:" + user[:MAX_CLIENT_KEY_CHARS]
    return "addr:" + (peer or "unknown")


def tag_client(processed: Iterable[ProcessedRequest], client: str) -> None:
    """Name the client on each of its core requests: the core takes grammar compiles
    round-robin over clients, so one client's large grammars do not hold up another's, and
    its scheduler is fair among clients for the slots (core/fairness.py)."""
    for p in processed:
        for r in p.requests:
            r.client = client
