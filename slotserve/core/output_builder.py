"""A step's SchedulerOutput, built from what schedule() decided, and the optimistic advance.

Kept apart from the scheduler's decisions: this is bookkeeping of what was decided (the
worker's view of each request, the slot ledger's commit), not a decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotserve.core.block_pool import KVCacheBlock
from slotserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from slotserve.core.request import Request

if TYPE_CHECKING:
    from slotserve.core.scheduler import Scheduler


def build_output(sched: Scheduler, scheduled_new: list[Request],
                 scheduled_running: list[Request], num_scheduled: dict[str, int],
                 new_blocks_of: dict[str, list[KVCacheBlock]]) -> SchedulerOutput:
    get_block_ids = sched.kv_cache_manager.get_block_ids
    lora_slots = sched.lora_slots
    new_data = [
        NewRequestData(r.request_id, list(r.prompt_token_ids), list(r.all_token_ids),
                       get_block_ids(r.request_id), r.num_computed_tokens, r.sampling_params,
                       r.num_output_tokens, r.eos_token_id, lora_slots.slot(r.request_id))
        for r in scheduled_new
    ]
    cached = CachedRequestData(
        req_ids=[r.request_id for r in scheduled_running],
        new_block_ids=[[b.block_id for b in nb] if (nb := new_blocks_of[r.request_id])
                       else None for r in scheduled_running],
        num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
    )
    out = SchedulerOutput(
        scheduled_spec_decode_tokens=(sched.spec.take_scheduled(num_scheduled, sched.now)
                                      if sched.spec is not None else {}),
        scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=sched.finished_req_ids,
        preempted_req_ids=sched.preempted_req_ids,
        lora_loads=lora_slots.take_loads(),
    )
    sched.slot_ledger.commit([r.request_id for r in scheduled_new])
    # Swapped out, not cleared: the output keeps this step's sets.
    sched.finished_req_ids = set()
    sched.preempted_req_ids = set()
    # Optimistic advance: the tokens count as computed once they are handed out.
    for r in scheduled_running:
        r.num_computed_tokens += num_scheduled[r.request_id]
    for r in scheduled_new:
        r.num_computed_tokens += num_scheduled[r.request_id]
    return out
