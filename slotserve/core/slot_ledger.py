"""The scheduler's authoritative record of which request ids hold a worker slot.

It is updated from the very outputs the scheduler emits, so it mirrors the worker's slot
table by construction: an id becomes a holder when it is emitted in `scheduled_new_reqs` and
stops being one when it is emitted in `finished_req_ids | preempted_req_ids`. Admission asks
the ledger, never `len(running)`, so idle sessions, requests preempted outside `schedule()`
and sessions waiting with a queued chunk are all counted. Every operation is O(1).
"""

from __future__ import annotations


class SlotLedger:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        # Holders as of the last emitted output (what the worker holds right now).
        self.holders: set[str] = set()
        # Holders whose release will go out in the next output.
        self.releasing: set[str] = set()
        # Ids admitted in the schedule() under way that need a fresh slot.
        self.claimed_this_step = 0

    def holds(self, req_id: str) -> bool:
        """Will req_id still hold its slot after the next output's releases?"""
        return req_id in self.holders and req_id not in self.releasing

    def release(self, req_id: str) -> None:
        if req_id in self.holders:
            self.releasing.add(req_id)

    def num_free_slots(self) -> int:
        return (self.max_num_seqs - len(self.holders) + len(self.releasing)
                - self.claimed_this_step)

    def needs_slot(self, req_id: str) -> bool:
        # An idle or promoted session keeps its slot: the worker re-adds it under the same id.
        return not self.holds(req_id)

    def claim(self, req_id: str) -> None:
        if self.needs_slot(req_id):
            self.claimed_this_step += 1

    def commit(self, new_req_ids: list[str]) -> None:
        """Apply an emitted output: releases first, then (re)claims, as the worker does."""
        if self.releasing:
            self.holders -= self.releasing
            self.releasing = set()
        self.holders.update(new_req_ids)
        self.claimed_this_step = 0
        assert len(self.holders) <= self.max_num_seqs, "slot ledger over capacity"
