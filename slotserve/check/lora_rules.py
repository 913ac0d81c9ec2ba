"""The checker's rules for adapter slots (issue 19), on its own model of the worker's table.

- the adapter rule: a step's scheduled requests use at most max_loras distinct adapters;
- a slot is loaded only while no request that holds a worker slot (scheduled, paused, or
  promoted) uses it, and every request's slot holds its own adapter when it runs;
- hashes keyed by adapter: one block hash never serves requests of two adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotserve.errors import InvariantViolation

if TYPE_CHECKING:
    from slotserve.core.outputs import SchedulerOutput
    from slotserve.core.scheduler import Scheduler

# Hashes remembered for the hash rule; past it the memory starts over (long engine runs).
_MAX_HASHES = 200_000


def _fail(rule: str, message: str) -> None:
    raise InvariantViolation(f"[{rule}] {message}")


class LoRASlotModel:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.max_loras = scheduler.scheduler_config.max_loras
        self.slot_adapter: dict[int, int] = {}  # slot -> adapter id loaded there
        self.users: dict[str, int] = {}  # slot holder -> the adapter slot it uses
        self.hash_adapter: dict[bytes, int] = {}  # block hash -> adapter id (0: base)
        self.num_hashes_seen: dict[str, int] = {}  # request -> its hashes checked so far

    def on_schedule(self, out: SchedulerOutput) -> None:
        if not self.max_loras:
            return  # LoRA off: no request with an adapter gets a slot (lora_slots.py)
        users = self.users
        for rid in out.released_req_ids:
            users.pop(rid, None)
            self.num_hashes_seen.pop(rid, None)
        for new in out.scheduled_new_reqs:
            users.pop(new.req_id, None)  # a stale same-id slot is dropped first
        for slot, lora in out.lora_loads.items():
            if not 0 <= slot < self.max_loras:
                _fail("adapter rule", f"adapter {lora.lora_name!r} sent to slot {slot} of "
                      f"{self.max_loras}")
            in_use = sorted(r for r, s in users.items() if s == slot)
            if in_use:
                _fail("adapter slot", f"slot {slot} reassigned to adapter {lora.lora_name!r} "
                      f"while {in_use} use adapter {self.slot_adapter.get(slot)} there")
            self.slot_adapter[slot] = lora.lora_int_id
        requests = self.scheduler.requests
        for new in out.scheduled_new_reqs:
            if new.lora_slot >= 0:
                users[new.req_id] = new.lora_slot
        adapters: set[int] = set()
        for rid in out.num_scheduled_tokens:
            r = requests[rid]
            want = r.lora_request.lora_int_id if r.lora_request is not None else 0
            slot = users.get(rid, -1)
            have = self.slot_adapter.get(slot, -1) if slot >= 0 else 0
            if have != want:
                _fail("adapter slot", f"request {rid!r} runs with adapter {have} (slot "
                      f"{slot}), not its own {want}")
            if want:
                adapters.add(want)
            self._check_hashes(rid, r.block_hashes, want)
        if len(adapters) > self.max_loras:
            _fail("adapter rule", f"{len(adapters)} distinct adapters {sorted(adapters)} in "
                  f"one step, over max_loras={self.max_loras}")

    def _check_hashes(self, rid: str, hashes: list[bytes], adapter: int) -> None:
        seen = self.hash_adapter
        if len(seen) > _MAX_HASHES:
            seen.clear()
        start = self.num_hashes_seen.get(rid, 0)
        if start > len(hashes):
            start = 0  # its hashes were rebuilt
        self.num_hashes_seen[rid] = len(hashes)
        for h in hashes[start:]:
            other = seen.setdefault(h, adapter)
            if other != adapter:
                _fail("adapter hash", f"request {rid!r} (adapter {adapter}) shares a block "
                      f"hash with adapter {other}: the prefix cache is not keyed by adapter")
