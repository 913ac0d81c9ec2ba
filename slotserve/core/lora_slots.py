"""The scheduler's ledger of the worker's `max_loras` adapter slots (issue 19).

Same construction as the request-slot ledger: a request uses its adapter's slot exactly while
it holds a request slot (running, or a paused session keeping its slot), so `acquire` is
called where a request claims its request slot and `release` wherever it gives it up. A slot
changes adapter only when no request uses it (the least recently used unused adapter gives
its slot up), and every change goes out in the next SchedulerOutput (`lora_loads`), before the
step whose tokens use it. Distinct adapters in a step <= max_loras follows: every scheduled
adapter holds a slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from slotserve.lora.request import LoRARequest

if TYPE_CHECKING:
    from slotserve.core.request import Request
    from slotserve.core.sessions import StreamingSessions


class LoRASlotLedger:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        # adapter id -> slot, for the adapters the worker holds (or receives in the next output)
        self.slot_of: dict[int, int] = {}
        self.adapter_in: list[int] = [0] * max_loras  # slot -> adapter id (0: empty)
        self.users: dict[int, set[str]] = {}  # adapter id -> requests using its slot
        self.adapter_of: dict[str, int] = {}  # request id -> adapter id
        self.last_use: dict[int, int] = {}  # adapter id -> tick of its last acquire (LRU)
        self.tick = 0
        # slot -> adapter to load there, for the next output
        self.pending: dict[int, LoRARequest] = {}

    def _slot_for(self) -> int | None:
        """An empty slot, else the least recently used adapter's that nobody uses."""
        if 0 in self.adapter_in:
            return self.adapter_in.index(0)
        unused = [a for a in self.slot_of if not self.users.get(a)]
        if not unused:
            return None
        victim = min(unused, key=self.last_use.__getitem__)
        return self.slot_of.pop(victim)

    def can_acquire(self, req_id: str, lora: LoRARequest | None, new_adapters: bool) -> bool:
        """Whether the request may run now. `new_adapters=False` (a request before it waits
        for a slot) admits only requests that already use their slot: the others wait too,
        so the slots in use drain and the waiting one is not starved."""
        if lora is None or req_id in self.adapter_of:
            return True
        if not new_adapters:
            return False
        return (lora.lora_int_id in self.slot_of or 0 in self.adapter_in
                or any(not self.users.get(a) for a in self.slot_of))

    def acquire(self, req_id: str, lora: LoRARequest | None) -> None:
        if lora is None or req_id in self.adapter_of:
            return
        aid = lora.lora_int_id
        if aid not in self.slot_of:
            slot = self._slot_for()
            assert slot is not None, "no adapter slot: can_acquire() was not asked"
            self.slot_of[aid] = slot
            self.adapter_in[slot] = aid
            self.pending[slot] = lora
        self.users.setdefault(aid, set()).add(req_id)
        self.adapter_of[req_id] = aid
        self.tick += 1
        self.last_use[aid] = self.tick

    def reclaim_idle(self, sessions: StreamingSessions, now: float,
                     reclaim: Callable[[Request], None]) -> bool:
        """For a request that waits for an adapter slot: the idle sessions past their grace
        period that alone keep the least recently used such adapter's slot give up their
        request slots and KV (`reclaim`), as for a waiting request's request slot. False when
        there are none."""
        past = {rid for rid in sessions.idle
                if now - sessions.idle_since[rid] > sessions.grace_s}
        pinned = [a for a in self.slot_of if self.users.get(a) and self.users[a] <= past]
        if not pinned:
            return False
        victim = min(pinned, key=self.last_use.__getitem__)
        for rid in sorted(self.users[victim]):
            reclaim(sessions.idle[rid])
        return True

    def release(self, req_id: str) -> None:
        aid = self.adapter_of.pop(req_id, None)
        if aid is not None:
            self.users[aid].discard(req_id)

    def slot(self, req_id: str) -> int:
        aid = self.adapter_of.get(req_id)
        return -1 if aid is None else self.slot_of[aid]

    def take_loads(self) -> dict[int, LoRARequest]:
        loads, self.pending = self.pending, {}
        return loads
