"""Admission control for completions and chat (issue 11, item 6).

A request is *waiting* from the moment it is accepted until it produces its first output: in
the front's queue here, or in the engine before its first token. Two bounds hold over waiting
requests, on sequences (prompts x n) and on tokens (each sequence's prompt plus max_tokens:
the work it can still queue); a request that would pass either gets 429 with a Retry-After
estimated from how fast waiting sequences have been starting. One client may hold at most a
share of either bound, so its burst is refused before it fills the queue for everyone else.

Fairness: accepted requests wait here in one queue per client and go to the engine round-robin
over clients, while the engine holds at most `core_window` sequences that have not started
(its waiting queue is FCFS; keeping it short keeps this order). So a client's first token
waits behind at most one request of each other client, not behind another client's burst.

A client is the request's `user` field (OpenAI's end-user id) when given, else the peer
address. A client that sends a different `user` with every request splits its own share;
the global bounds still hold.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TypeVar

from slotserve.entrypoints.openai.errors import APIError

T = TypeVar("T")
# The window over which the rate at which waiting sequences start is measured.
RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60
MAX_CLIENT_KEY_CHARS = 256


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
    # "queued" (here), "in_core" (sent to the engine, no output yet), "done".
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
    core_window: int
    waiting: _Totals = field(default_factory=_Totals)
    by_client: dict[str, _Totals] = field(default_factory=dict)
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)
    # Clients with queued tickets, in round-robin order.
    turn: deque[str] = field(default_factory=deque)
    in_core_seqs: int = 0
    started_times: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))
    num_refused: int = 0

    def admit(self, client: str, num_seqs: int, num_tokens: int) -> Ticket:
        """Accept a request (queued until `wait` returns) or raise a 429 APIError."""
        mine = self.by_client.get(client)
        if self.waiting.seqs:
            self._check(self.waiting.seqs + num_seqs, self.max_waiting_seqs,
                        self.waiting.tokens + num_tokens, self.max_waiting_tokens,
                        "the server")
            if mine is not None:
                share = self.max_client_share
                self._check(mine.seqs + num_seqs, max(1, int(share * self.max_waiting_seqs)),
                            mine.tokens + num_tokens,
                            max(1, int(share * self.max_waiting_tokens)), "this client")
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
        """The request produced its first output, ended, or was abandoned: it waits no more."""
        if ticket.state == "done":
            return
        if ticket.state == "queued":
            queue = self.queues[ticket.client]
            queue.remove(ticket)
            if not queue:
                del self.queues[ticket.client]
                self.turn.remove(ticket.client)
        else:
            self.in_core_seqs -= ticket.num_seqs
            self.started_times.append((time.monotonic(), ticket.num_seqs))
        ticket.state = "done"
        self._add(ticket.client, -ticket.num_seqs, -ticket.num_tokens)
        if not ticket.released.done():
            ticket.released.cancel()
        self._dispatch()

    async def track(self, ticket: Ticket, outputs: AsyncGenerator[T, None]
                    ) -> AsyncGenerator[T, None]:
        """`outputs`, marking the ticket started at the first one (or at the end)."""
        try:
            async for item in outputs:
                self.started(ticket)
                yield item
        finally:
            self.started(ticket)
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

    def _dispatch(self) -> None:
        while self.turn and self.in_core_seqs < self.core_window:
            client = self.turn.popleft()
            queue = self.queues[client]
            ticket = queue.popleft()
            if queue:
                self.turn.append(client)
            else:
                del self.queues[client]
            ticket.state = "in_core"
            self.in_core_seqs += ticket.num_seqs
            ticket.released.set_result(None)

    def _check(self, seqs: int, max_seqs: int, tokens: int, max_tokens: int, who: str) -> None:
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
