"""Fairness among clients for the worker slots (FCFS policy, requests that name a client).

The server names each request's client (its `user`, else the peer address; offline requests
name none and are plain FCFS). While two or more clients have live requests, two rules:

- A free slot goes to the waiting request of the client holding the fewest slots (FCFS within
  a client and on ties): a client's first request does not queue behind another's burst.
- When no slot is free, a running request of the client holding the most is preempted
  (recompute, the latest it admitted) for a waiting request whose client holds at least two
  fewer: so one client's first token waits one step, not for another client's requests to end.
  The gap of two keeps it from swinging back (after the swap the victim still holds at least
  as many). The front's admission keeps each client within its share of the slots; this
  covers the clients that reach their shares together and fill every slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from slotserve.core.request import Request
from slotserve.core.request_queue import FCFSRequestQueue
from slotserve.core.slot_ledger import SlotLedger

if TYPE_CHECKING:
    from slotserve.core.scheduler import Scheduler


def fair_queue(sched: Scheduler) -> FCFSRequestQueue | None:
    """The waiting queue, when it is fair among clients: FCFS, with live requests of two
    clients or more (`Scheduler.live_clients`)."""
    waiting = sched.waiting
    if len(sched.live_clients) > 1 and isinstance(waiting, FCFSRequestQueue):
        return waiting
    return None


def slots_by_client(running: Iterable[Request], idle: Iterable[Request],
                    ledger: SlotLedger) -> dict[str | None, int]:
    """Worker slots held per client: running requests, and idle sessions that keep one."""
    held: dict[str | None, int] = {}
    for r in running:
        held[r.client] = held.get(r.client, 0) + 1
    for r in idle:
        if ledger.holds(r.request_id):
            held[r.client] = held.get(r.client, 0) + 1
    return held


def fair_key(held: dict[str | None, int], holds: Callable[[str], bool]
             ) -> Callable[[Request], int]:
    """The waiting order: whoever holds a slot already first (it takes no new one), then
    the client holding the fewest."""
    def key(r: Request) -> int:
        return -1 if holds(r.request_id) else held.get(r.client, 0)
    return key


def fair_victim(sched: Scheduler) -> Request | None:
    """With no slot free: the running request to preempt so that a waiting one of a client
    holding at least two fewer slots gets one, or None."""
    ledger = sched.slot_ledger
    if ledger.num_free_slots() > 0 or not sched.running:
        return None
    held = slots_by_client(sched.running, sched.sessions.idle.values(), ledger)
    waiter = min((r for r in sched.waiting if not ledger.holds(r.request_id)),
                 key=lambda r: held.get(r.client, 0), default=None)
    if waiter is None:
        return None
    richest = max(held.get(r.client, 0) for r in sched.running)
    if richest < held.get(waiter.client, 0) + 2:
        return None
    # It could not use the slot: it waits for an adapter slot, or an idle session past its
    # grace period gives it one anyway.
    if not sched.lora_slots.can_acquire(waiter.request_id, waiter.lora_request, True) or (
            sched.sessions.idle
            and sched.sessions.slot_for_waiting(sched.now, ledger.holds, waiter)):
        return None
    # The latest admitted request of the client holding the most: the least work lost.
    return next(r for r in reversed(sched.running) if held.get(r.client, 0) == richest)
