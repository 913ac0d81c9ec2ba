"""The worker's fixed table of `max_num_reqs` request slots (vLLM MRV2's RequestState slab).

It applies a SchedulerOutput in the contract's order: release finished and preempted ids,
then (re)claim a slot for each new request, then check that every cached request holds one.
"""

from __future__ import annotations

from slotserve.core.outputs import SchedulerOutput
from slotserve.errors import InvariantViolation, SlotOverflowError


class RequestSlots:
    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        # A stack, as in vLLM: the most recently freed index is reused first.
        self.free_indices: list[int] = list(range(max_num_reqs))
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.req_id_to_index)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.req_id_to_index

    @property
    def holders(self) -> set[str]:
        return set(self.req_id_to_index)

    def add_request(self, req_id: str) -> int:
        if req_id in self.req_id_to_index:
            raise InvariantViolation(f"request {req_id!r} already holds slot "
                                     f"{self.req_id_to_index[req_id]}")
        if not self.free_indices:
            raise SlotOverflowError(
                f"No free indices: cannot give request {req_id!r} a slot; all "
                f"{self.max_num_reqs} slots are held by {sorted(self.req_id_to_index)}")
        index = self.free_indices.pop()
        self.req_id_to_index[req_id] = index
        self.index_to_req_id[index] = req_id
        return index

    def remove_request(self, req_id: str) -> int | None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            del self.index_to_req_id[index]
            self.free_indices.append(index)
        return index

    def apply(self, scheduler_output: SchedulerOutput) -> list[int]:
        """Apply one step's slot changes; returns the slot index of each new request."""
        for req_id in scheduler_output.finished_req_ids:
            self.remove_request(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            self.remove_request(req_id)
        new_indices = []
        for new in scheduler_output.scheduled_new_reqs:
            # Same-id re-add: a resumed session or preempted request drops its stale slot.
            self.remove_request(new.req_id)
            new_indices.append(self.add_request(new.req_id))
        for req_id in scheduler_output.scheduled_cached_reqs.req_ids:
            if req_id not in self.req_id_to_index:
                raise InvariantViolation(f"cached request {req_id!r} has no worker slot")
        return new_indices
