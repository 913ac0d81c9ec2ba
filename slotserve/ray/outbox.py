"""Many streamed answers in one Ray message: a replica's later SSE batches, multiplexed.

A Ray handle message costs the replica and the ingress about half a millisecond of CPU each
whatever it carries, and a streamed answer at stream interval 1 is one message per token:
on 2 cores that was most of the serving path's CPU (docs/RAY.md). So a streamed answer's
first batch (its start and first event) comes back on its own call, which stays open until
the answer ends (the router's in-flight count, retries and cancellation work per request as
before), and every later batch goes to the replica's `Outbox` for that caller. One long-lived
pinned call per replica (`Mux`, in the ingress) takes all of them at once: one message per
engine step for every request on that replica. The request's own call ends by saying how
many batches it sent there, so the ingress knows when the answer is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable
from typing import Any

Batch = list[dict[str, Any]]
# The replica method the pump calls (not a request: the router does not count it as load).
DRAIN_METHOD = "drain_outbox"
# The last message of an answer whose later batches went to the caller's outbox.
OUTBOXED = "slotserve.outboxed"
# After the first batch is ready, how long the outbox waits for the rest of the engine
# step's events (every request's SSE event of one step arrives within a few loop turns).
GATHER_S = 0.002


class Outbox:
    """A replica's later batches for one caller, taken all at once by `drain`."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Batch]] = []
        self.open = 0  # the caller's answers streaming here now
        self.ready = asyncio.Event()

    def put(self, stream_id: str, batch: Batch) -> None:
        self.items.append((stream_id, batch))
        self.ready.set()

    @contextlib.contextmanager
    def streaming(self) -> Any:
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1
            self.ready.set()  # a drain with nothing left to wait for returns

    async def drain(self) -> AsyncIterator[list[tuple[str, Batch]]]:
        """Everything put since the last message, until no answer streams here (the caller
        opens a new drain when it sends the next one)."""
        while self.items or self.open:
            await self.ready.wait()
            await asyncio.sleep(GATHER_S)
            self.ready.clear()
            items, self.items = self.items, []
            if items:
                yield items


async def split(batches: AsyncIterator[Batch], box: Outbox, stream_id: str
                ) -> AsyncIterator[Batch]:
    """An answer's batches for its own call: the first, then (if any went to `box`) how
    many batches went there."""
    sent = -1
    with box.streaming():
        async for batch in batches:
            if sent < 0:
                yield batch
            else:
                box.put(stream_id, batch)
            sent += 1
    if sent > 0:
        yield [{"type": OUTBOXED, "count": sent}]


class Mux:
    """The ingress side: one pump per replica while answers stream from it, each batch
    handed to its answer's queue."""

    def __init__(self, open_drain: Callable[[str], AsyncIterator[list[tuple[str, Batch]]]],
                 alive: Callable[[str], bool] = lambda replica: True) -> None:
        self.open_drain = open_drain
        # A pinned call to a replica Serve no longer lists would wait for it for ever.
        self.alive = alive
        self.queues: dict[str, asyncio.Queue[Batch]] = {}
        self.active: dict[str, int] = {}  # replica -> answers streaming from it
        self.pumps: dict[str, asyncio.Task[None]] = {}

    def register(self, stream_id: str) -> asyncio.Queue[Batch]:
        queue: asyncio.Queue[Batch] = asyncio.Queue()
        self.queues[stream_id] = queue
        return queue

    def unregister(self, stream_id: str) -> None:
        self.queues.pop(stream_id, None)

    @contextlib.contextmanager
    def streaming(self, replica: str) -> Any:
        self.active[replica] = self.active.get(replica, 0) + 1
        if replica not in self.pumps:
            # A context of its own: Ray would otherwise give the pump's call the id of the
            # request that started it, and the router matches completions by that id.
            self.pumps[replica] = asyncio.create_task(self._pump(replica),
                                                      context=contextvars.Context())
        try:
            yield
        finally:
            self.active[replica] -= 1

    async def _pump(self, replica: str) -> None:
        try:
            while self.active.get(replica) and self.alive(replica):
                got = False
                async for items in self.open_drain(replica):
                    got = True
                    for stream_id, batch in items:
                        if (queue := self.queues.get(stream_id)) is not None:
                            queue.put_nowait(batch)
                if not got:  # the replica's answers ended before the ingress relayed them
                    await asyncio.sleep(5 * GATHER_S)
        except Exception:  # noqa: BLE001 - each answer's own call reports its replica's death
            pass
        finally:
            del self.pumps[replica]
