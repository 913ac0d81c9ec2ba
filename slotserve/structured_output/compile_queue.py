"""The compile threads: one client's compiles never hold up another's.

Waiting compiles are queued per client (the client id the API puts on a core request), the
smallest grammar of a client first, and taken round-robin over the clients. At most one
compile per client runs at a time, on `threads` threads (two: llguidance drops the GIL while it
builds, and the step loop and the forward pass need the cores): a client's four 0.9 MB schemas
(6.6 s each) hold one thread and wait for each other, while another client's 20-byte regex
compiles at once on the other. The threads run at a lower priority (nice +10) than the step
loop and the front. Every request's deadline runs from when the core admitted it,
so a grammar that waits too long behind its own client's fails (and the manager cancels a
compile no request waits for any more before it starts).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# Grammar threads yield the CPU to the step loop and the threads that tokenize: on a machine
# with no spare core a compile or a validation then takes longer, and every other request
# does not.
NICE_INCREMENT = 10
_Entry = tuple[int, int, concurrent.futures.Future[Any], Callable[[], Any]]


class FairCompileExecutor:
    def __init__(self, thread_name: str, threads: int = 2) -> None:
        # Clients with waiting compiles, in round-robin order (a client goes to the back once
        # one of its compiles starts).
        self._queues: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._running: set[str] = set()
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{thread_name}-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., T], *args: Any, size: int = 0, client: str = ""
               ) -> concurrent.futures.Future[T]:
        """fn(*args) in `client`'s turn, after its smaller waiting ones."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compile queue is shut down")
            call: Callable[[], Any] = functools.partial(fn, *args)
            heapq.heappush(self._queues.setdefault(client, []),
                           (size, next(self._order), future, call))
            self._cond.notify()
        return future

    def _next(self) -> tuple[str, _Entry] | None:
        """The smallest waiting compile of the first client in turn with none running."""
        for client, queue in self._queues.items():
            if client not in self._running:
                entry = heapq.heappop(queue)
                del self._queues[client]
                if queue:
                    self._queues[client] = queue  # to the back of the round
                return client, entry
        return None

    def _run(self) -> None:
        lower_thread_priority(NICE_INCREMENT)
        while True:
            with self._cond:
                while not self._closed and (picked := self._next()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                assert picked is not None
                client, (_, _, future, fn) = picked
                self._running.add(client)
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._running.discard(client)
                    self._cond.notify_all()

    def shutdown(self) -> None:
        """Cancel what waits; compiles in progress finish on their own (they cannot be
        stopped) and their results are dropped."""
        with self._cond:
            self._closed = True
            pending, self._queues = list(self._queues.values()), OrderedDict()
            self._cond.notify_all()
        for queue in pending:
            for _, _, future, _ in queue:
                future.cancel()


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value (Linux schedules threads apart; elsewhere, or
    where it is not allowed, nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
