"""One compile thread that takes the smallest waiting grammar first.

Compiles run one at a time (llguidance drops the GIL while it builds, but the step loop and
the forward pass need the cores). In arrival order, one client's four 0.9 MB schemas (6 s
each) made another client's 20-byte regex wait 20 s; smallest first, a small grammar waits
at most for the compile in progress. A large grammar still compiles once no smaller one
waits (each request's own deadline bounds how long it waits for it).
"""

from __future__ import annotations

import concurrent.futures
import functools
import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class SmallestFirstExecutor:
    def __init__(self, thread_name: str) -> None:
        self._heap: list[tuple[int, int, concurrent.futures.Future[Any],
                               Callable[[], Any]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, size: int = 0
               ) -> concurrent.futures.Future[T]:
        """fn(*args) once nothing smaller waits (ThreadPoolExecutor's call, plus `size`)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compile queue is shut down")
            call: Callable[[], Any] = functools.partial(fn, *args)
            heapq.heappush(self._heap, (size, next(self._order), future, call))
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, future, fn = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel what waits; a compile in progress finishes on its own (it cannot be
        stopped) and its result is dropped."""
        with self._cond:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cond.notify_all()
        for _, _, future, _ in pending:
            future.cancel()
