"""Waiting queues: FCFS (a deque) and PRIORITY (a heap ordered by Request.__lt__)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from slotserve.core.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def add_resumed_request(self, request: Request, is_resumed: Callable[[Request], bool]) -> None:
        """Ahead of newcomers but behind sessions resumed earlier (FIFO among resumes)."""
        q = self._q
        i = 0
        while i < len(q) and is_resumed(q[i]):
            i += 1
        q.insert(i, request)

    def peek_request(self) -> Request:
        return self._q[0]

    def pop_request(self) -> Request:
        return self._q.popleft()

    def remove_request(self, request: Request) -> None:
        self._q.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._q)


class PriorityRequestQueue:
    """There is no front in a heap: a prepended (preempted) request re-enters by priority."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request

    def add_resumed_request(self, request: Request, is_resumed: Callable[[Request], bool]) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._heap)


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
