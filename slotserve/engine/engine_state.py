"""A snapshot of who holds what in the engine core: the slot table, the KV blocks, the queues.

`EngineCore.get_engine_state()` takes it between two steps, so the worker's slot table and the
scheduler's SlotLedger agree in it by the slot contract. It carries request ids and counts
only, never token ids or text: it is what `GET /v1/engine/state` (and the web page) shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slotserve.core.request import RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.worker.slots import RequestSlots

# free: nobody holds it. running: a request being scheduled. idle: a streaming session
# waiting for its next chunk, keeping slot and KV. waiting: a holder queued to run again
# (a session whose next chunk came). released: the scheduler has let it go (finished or
# preempted) and the worker frees it with the next step.
SlotStatus = Literal["free", "running", "idle", "waiting", "released"]


@dataclass(slots=True)
class SlotState:
    index: int
    status: SlotStatus
    request_id: str | None = None
    # Prompt plus output tokens, and the output tokens alone; None when the scheduler no
    # longer knows the request (released after it finished).
    num_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(slots=True)
class EngineState:
    num_steps: int
    max_num_seqs: int
    # The held slots only, by index (the rest are free): a poll of an idle 256-slot engine
    # pickles next to nothing.
    held_slots: list[SlotState]
    block_size: int
    # Usable KV blocks = used (some request holds it) + cached (free, but keeps a prefix-cache
    # entry a later request may hit) + free (empty).
    num_blocks: int
    num_blocks_used: int
    num_blocks_cached: int
    num_blocks_free: int
    num_running: int
    # The engine's waiting queue (the front's admission queue is reported by the front).
    num_waiting: int
    num_idle_sessions: int
    num_waiting_for_grammar: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


def _slot_status(scheduler: Scheduler, request_id: str) -> tuple[SlotStatus, int | None,
                                                                  int | None]:
    r = scheduler.requests.get(request_id)
    if r is None or request_id in scheduler.slot_ledger.releasing:
        status: SlotStatus = "released"
    elif r.status == RequestStatus.RUNNING:
        status = "running"
    elif r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
        status = "idle"
    else:
        status = "waiting"
    if r is None:
        return status, None, None
    return status, r.num_tokens, r.num_output_tokens


def snapshot_engine_state(scheduler: Scheduler, worker_slots: RequestSlots, num_steps: int,
                          num_waiting_for_grammar: int) -> EngineState:
    held = []
    for index, rid in sorted(worker_slots.index_to_req_id.items()):
        status, num_tokens, num_output = _slot_status(scheduler, rid)
        held.append(SlotState(index, status, rid, num_tokens, num_output))
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free = pool.get_num_free_blocks()
    cached = sum(1 for b in pool.cached_block_hash_to_block.values() if b.ref_cnt == 0)
    return EngineState(
        num_steps=num_steps, max_num_seqs=worker_slots.max_num_reqs, held_slots=held,
        block_size=kv.block_size,
        num_blocks=pool.num_usable_blocks, num_blocks_used=pool.num_usable_blocks - free,
        num_blocks_cached=cached, num_blocks_free=free - cached,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_idle_sessions=len(scheduler.sessions.idle),
        num_waiting_for_grammar=num_waiting_for_grammar,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=kv.prefix_cache_stats.queries,
        prefix_cache_hits=kv.prefix_cache_stats.hits)
