"""Waiting queues: FCFS (a deque) and PRIORITY (a heap ordered by Request.__lt__)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from slotserve.core.request import Request


class _Queue:
    """What both queues share; `_items` is a deque (FCFS) or a heap list (priority)."""

    _items: deque[Request] | list[Request]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._items)


class FCFSRequestQueue(_Queue):
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._items.append(request)

    def prepend_request(self, request: Request) -> None:
        self._items.appendleft(request)

    def add_resumed_request(self, request: Request, is_resumed: Callable[[Request], bool]) -> None:
        """Ahead of newcomers but behind sessions resumed earlier (FIFO among resumes)."""
        q = self._items
        i = 0
        while i < len(q) and is_resumed(q[i]):
            i += 1
        q.insert(i, request)

    def peek_request(self) -> Request:
        return self._items[0]

    def pop_request(self) -> Request:
        return self._items.popleft()

    def bring_forward(self, key: Callable[[Request], int]) -> None:
        """Move the first request with the smallest key to the front (the others keep their
        order)."""
        q = self._items
        best_i, best_k = 0, key(q[0])
        for i in range(1, len(q)):
            k = key(q[i])
            if k < best_k:
                best_i, best_k = i, k
        if best_i:
            r = q[best_i]
            del q[best_i]
            q.appendleft(r)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._items = deque(r for r in self._items if id(r) not in drop)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityRequestQueue(_Queue):
    """There is no front in a heap: a prepended (preempted) request re-enters by priority."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._items, request)

    prepend_request = add_request

    def add_resumed_request(self, request: Request, is_resumed: Callable[[Request], bool]) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._items[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._items)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._items = [r for r in self._items if id(r) not in drop]
        heapq.heapify(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._items))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
