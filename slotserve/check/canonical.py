"""A canonical key for a Harness state: equal keys mean the same future behaviour, up to
renaming.

The key covers everything that a later event can observe or that a check compares:
the scheduler's queues (order where order matters), each request's tokens, cursor, params,
priority and session queue; the KV manager's block tables and cached-block counts; the block
pool's ref counts, hashes, free-queue order and hash map; the slot ledger and the adapter-slot ledger; pending releases
and outputs; the checker's model of the worker; the worker's slot holders; the in-flight
outputs with their samplers; the client's open sessions; and the session clock. Three
renamings and abstractions merge states that differ only in names:

- Request ids become their rank in arrival order among the ids present. The scheduler only
  compares ids for equality (ordering ties between requests never happen: arrival times are
  distinct), events name requests by position, and new ids are always fresh.
- Block ids become their rank in a traversal (request tables in canonical order, then the free
  queue, then any block reached neither way, by id). Blocks are only compared for identity and
  handed out in free-queue order; the null block is never renamed.
- Times become what can still be compared: arrival times their rank; for an idle session,
  its idle time in whole seconds up to just past the longest idle threshold (past it, every
  future comparison is decided); for the expiry check, whether it is due. The harness clock
  moves by whole-second jumps (Tick) plus drift far below a second, so these values decide
  every future comparison.

A request's grammar (check.grammar's counting grammar in the vocabulary) is kept whole: what
it consumed, whether it is complete or failed, and its session history's length.

Left out because no control flow reads them: counters (preemptions, prefix-cache stats, the
checker's step count), num_cached_tokens and stop_reason (reported, never read back), sampling fields the scheduler never reads (constant in the vocabulary anyway),
and the worker's slot indices (only the set of holders decides whether a claim fails). Block
hashes are content hashes, kept as small interned numbers. The key is a 128-bit digest of the
form: a collision among a million states has a probability near 1e-27.
"""

from __future__ import annotations

import hashlib
import itertools
import marshal
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from slotserve.check.events import idle_thresholds

if TYPE_CHECKING:
    from slotserve.check.harness import Harness
    from slotserve.core.request import Request
    from slotserve.sampling_params import SamplingParams


def _seq(req_id: str) -> int:
    return int(req_id[1:])  # the harness names requests r1, r2, ... in arrival order


def canonical_key(h: Harness) -> bytes:
    """A 16-byte digest of the canonical form.

    marshal format 2 has no back-references, so equal forms always give equal bytes (later
    formats share repeated objects, and whether they do depends on reference counts)."""
    form = canonical_form(h)
    return hashlib.blake2b(marshal.dumps(form, 2), digest_size=16).digest()


def _ranks(ids: Iterable[str], rid: dict[str, int]) -> tuple[int, ...]:
    return tuple(sorted([rid[r] for r in ids]))


def canonical_form(h: Harness) -> tuple[Any, ...]:
    s = h.sched
    # Idle time matters up to the longest threshold; past it every comparison is decided.
    idle_cap = math.ceil(max(idle_thresholds(s))) + 1
    kv = s.kv_cache_manager
    pool = kv.block_pool
    ledger = s.slot_ledger
    requests = s.requests
    tables = kv.req_to_blocks
    worker_tables = h.checker.block_tables

    # --- request ids: every id present anywhere, ranked by arrival.
    ids: set[str] = set(requests)
    ids.update(s.finished_req_ids, s.preempted_req_ids, ledger.holders, worker_tables,
               h.slots.req_id_to_index, tables)
    for o in s.pending_outputs:
        ids.add(o.request_id)
    for out, _ in h.in_flight:
        ids.update(out.num_scheduled_tokens)
    order = sorted(ids, key=_seq)
    rid = {r: i for i, r in enumerate(order)}

    # --- times: arrival ranks over requests and queued session chunks.
    sessions = s.sessions
    times = [r.arrival_time for r in requests.values()]
    for chunks in sessions.queued.values():
        times.extend(u.arrival_time for u in chunks if u is not None)
    times.sort()
    time_rank = {t: i for i, t in enumerate(times)}
    now = h.now

    # --- block ids: tables in canonical request order, then the free queue, then the rest.
    bid: dict[int, int] = {0: 0}
    free_queue = [b.block_id for b in pool.free_block_queue]
    for block_id in itertools.chain((b.block_id for r in order for b in tables.get(r, ())),
                                    free_queue):
        bid.setdefault(block_id, len(bid))  # the next rank, for an id not ranked yet
    if len(bid) < pool.num_blocks:
        for block_id in itertools.chain((b for t in worker_tables.values() for b in t),
                                        (blk.block_id for blk in pool.blocks)):
            bid.setdefault(block_id, len(bid))

    hash_ids = _HASH_IDS

    def hid(x: bytes | None) -> int:
        if x is None:
            return -1
        n = hash_ids.get(x)
        if n is None:
            n = hash_ids[x] = len(hash_ids)
        return n

    def params_form(p: SamplingParams) -> tuple[Any, ...]:
        return (p.max_tokens, p.min_tokens, tuple(p.stop_token_ids or ()), p.ignore_eos)

    def update_form(u: Request | None) -> tuple[Any, ...] | None:
        if u is None:
            return None
        return (tuple(u.prompt_token_ids), params_form(u.sampling_params),
                time_rank[u.arrival_time], u.priority, u.eos_token_id)

    request_forms = []
    for req_id in order:
        if req_id not in requests:
            continue
        r = requests[req_id]
        idle = -1
        if req_id in sessions.idle:
            # Whole seconds: the clock jumps by whole seconds, plus drift far below 0.5 s.
            idle = min(round(now - sessions.idle_since[req_id]), idle_cap)
        queued = sessions.queued.get(req_id)
        queue = None if queued is None else tuple([update_form(u) for u in queued])
        sor = r.structured_output_request
        grammar = None if sor is None else (
            type(sor.grammar).__name__, getattr(sor.grammar, "length", None),
            tuple(sor.grammar.consumed_token_ids), sor.grammar.is_terminated(),
            sor.grammar.error, len(sor.prior_output_token_ids))
        request_forms.append((
            rid[req_id], int(r.status), tuple(r.prompt_token_ids), tuple(r.all_token_ids),
            len(r.output_token_ids), r.num_computed_tokens, r.max_tokens,
            params_form(r.sampling_params), r.eos_token_id, r.priority,
            time_rank[r.arrival_time], r.resumable, r.cache_salt,
            tuple([hid(x) for x in r.block_hashes]), queue, idle, grammar,
            r.lora_request.lora_int_id if r.lora_request else 0))

    blocks: list[tuple[int, int]] = [(0, 0)] * pool.num_blocks
    for b in pool.blocks:
        blocks[bid[b.block_id]] = (b.ref_cnt, hid(b.block_hash))
    num_cached = kv.num_cached_block
    return (
        tuple(request_forms),
        tuple([rid[r.request_id] for r in s.running]),
        tuple([rid[r.request_id] for r in s.waiting]),  # FCFS: queue order; priority: sorted
        tuple([rid[r] for r in sessions.idle]),
        _ranks(s.finished_req_ids, rid),
        _ranks(s.preempted_req_ids, rid),
        tuple([(rid[o.request_id], o.finish_reason, o.finished) for o in s.pending_outputs]),
        _ranks(ledger.holders, rid),
        _ranks(ledger.releasing, rid),
        ledger.claimed_this_step,
        tuple([(rid[r], tuple([bid[b.block_id] for b in tables[r]]), num_cached.get(r, -1))
               for r in order if r in tables]),
        tuple(sorted([(rid[r], n) for r, n in num_cached.items() if r not in tables])),
        tuple(blocks),
        tuple([bid[b] for b in free_queue]),
        tuple(sorted([(hid(x), bid[b.block_id])
                      for x, b in pool.cached_block_hash_to_block.items()])),
        tuple(sorted([(rid[r], tuple([bid[b] for b in t])) for r, t in worker_tables.items()])),
        _ranks(h.slots.req_id_to_index, rid),
        # update_from_output and a failed step read only the scheduled ids of an output.
        tuple([(tuple([rid[r] for r in out.num_scheduled_tokens]),
                tuple([rid[r] for r in samplers]),
                # and the drafts it verifies (the rollback reads them)
                tuple(sorted([(rid[r], tuple(d))
                              for r, d in out.scheduled_spec_decode_tokens.items()])))
               for out, samplers in h.in_flight]),
        tuple([rid[r] for r in h.open_sessions]),
        now >= sessions.next_timeout_check,
        _lora_form(h, rid),
    )


def _lora_form(h: Harness, rid: dict[str, int]) -> tuple[Any, ...]:
    """The adapter-slot ledger (slots, users, LRU order, pending loads) and the checker's
    model of the worker's adapter table. Adapter ids are not renamed (the menu's few)."""
    ledger = h.sched.lora_slots
    if not ledger.max_loras:
        return ()
    lru = sorted(ledger.slot_of, key=ledger.last_use.__getitem__)
    return (tuple(ledger.adapter_in), tuple(lru),
            tuple(sorted((rid[r], a) for r, a in ledger.adapter_of.items())),
            tuple(sorted((s, r.lora_int_id) for s, r in ledger.pending.items())),
            tuple(sorted(h.checker.lora.slot_adapter.items())),
            tuple(sorted((rid[r], s) for r, s in h.checker.lora.users.items())))


# Block hashes are content hashes (no ids in them): interning them is a renaming-free map.
_HASH_IDS: dict[bytes, int] = {}
