"""The invariant checker.

It applies each SchedulerOutput to its own model of the worker's slot table and block tables
(independent of the scheduler's SlotLedger) and of the block pool, and raises
InvariantViolation naming the request and the rule the moment they disagree:

- slot rule: after the releases and (re)claims of a step, holders <= max_num_seqs;
- every cached request holds a slot, every new request is re-added or claims one;
- every release is of a holder, and every holder is eventually released;
- scheduled token counts are positive, sum to the total, fit the budget, and stay within
  each request's tokens and max_model_len; each scheduled token has a KV slot;
- the worker's block table for each request equals the KV manager's;
- free + used blocks == usable blocks; the scheduler's ledger mirrors the worker model;
- idle sessions hold slots only within bounds: at most max_idle_sessions of them keep a slot or
  KV, and a step that schedules nothing never leaves a request waiting for a slot while an
  idle session past its grace period holds one;
- each request's grammar has consumed exactly the output tokens the request kept (a
  session's: its earlier chunks' kept outputs, then the current chunk's);
- speculative decoding: drafts only for a scheduled decoding request (its one token plus
  at most k drafts, all counted in its scheduled tokens and so in the budget); computed may
  run past the tokens by the drafts only; no block is hashed over a token that is not
  accepted (a request's hashed blocks lie within its tokens); after verification a request
  has computed exactly the tokens before its last (the rejected drafts rolled back);
- adapter slots (check/lora_rules.py): at most max_loras adapters a step, no slot reloaded
  while in use, block hashes keyed by adapter;
- once everything has finished, no block is in use and no slot is held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotserve.check.lora_rules import LoRASlotModel
from slotserve.core.request import RequestStatus
from slotserve.errors import InvariantViolation

if TYPE_CHECKING:
    from slotserve.core.outputs import SchedulerOutput
    from slotserve.core.scheduler import Scheduler
    from slotserve.worker.slots import RequestSlots


def _fail(rule: str, message: str) -> None:
    raise InvariantViolation(f"[{rule}] {message}")


class InvariantChecker:
    def __init__(self, scheduler: Scheduler, full_block_scan_every: int | None = None) -> None:
        self.scheduler = scheduler
        self.max_num_seqs = scheduler.max_num_running_reqs
        # Worker model: slot holders and their block tables.
        self.block_tables: dict[str, list[int]] = {}
        self.num_steps = 0
        # The full pool scan is O(num_blocks); on big pools it runs every few steps, while the
        # blocks of every scheduled request are checked on every step.
        if full_block_scan_every is None:
            full_block_scan_every = max(1, scheduler.kv_cache_manager.block_pool.num_blocks // 2048)
        self.full_block_scan_every = full_block_scan_every
        self.lora = LoRASlotModel(scheduler)

    @property
    def holders(self) -> set[str]:
        return set(self.block_tables)

    def on_schedule(self, out: SchedulerOutput) -> None:
        """Check one output right after schedule() returned it."""
        self.num_steps += 1
        tables = self.block_tables
        sched = self.scheduler
        # 1. Releases, as the worker applies them.
        for req_id in out.preempted_req_ids:
            if req_id not in tables:
                _fail("release", f"request {req_id!r} is reported preempted but holds no slot")
            del tables[req_id]
        for req_id in out.finished_req_ids:
            tables.pop(req_id, None)
        # 2. New requests: drop a stale same-id slot, then claim one.
        new_ids = set()
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            if rid in new_ids:
                _fail("unique", f"request {rid!r} appears twice in scheduled_new_reqs")
            new_ids.add(rid)
            tables.pop(rid, None)
            if len(tables) >= self.max_num_seqs:
                _fail("slot rule", f"No free indices: request {rid!r} needs a worker slot but "
                      f"all {self.max_num_seqs} are held by {sorted(tables)}")
            tables[rid] = list(new.block_ids)
            if new.prefill_token_ids[:len(new.prompt_token_ids)] != new.prompt_token_ids:
                _fail("tokens", f"request {rid!r}: prefill_token_ids does not start with the prompt")
        # 3. Cached requests must already hold a slot.
        cached = out.scheduled_cached_reqs
        for rid, nb in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid not in tables:
                _fail("cached holds slot", f"cached request {rid!r} has no worker slot")
            if rid in new_ids:
                _fail("unique", f"request {rid!r} is both new and cached")
            if nb:
                tables[rid].extend(nb)
        # 4. Token counts and budget.
        scheduled = out.num_scheduled_tokens
        if set(scheduled) != new_ids | set(cached.req_ids):
            _fail("tokens", "num_scheduled_tokens keys differ from the new and cached requests")
        total = 0
        bs = sched.block_size
        kv = sched.kv_cache_manager
        drafts = out.scheduled_spec_decode_tokens
        if drafts:
            self._check_drafts(out)
        for rid, n in scheduled.items():
            if n <= 0:
                _fail("tokens", f"request {rid!r} is scheduled {n} tokens")
            total += n
            r = sched.requests.get(rid)
            if r is None or r.status != RequestStatus.RUNNING:
                _fail("state", f"scheduled request {rid!r} is not RUNNING ({r!r})")
            assert r is not None
            # num_computed_tokens was advanced optimistically by schedule().
            if r.num_computed_tokens > r.num_tokens + len(drafts.get(rid, ())):
                _fail("tokens", f"request {rid!r} computes past its tokens: {r!r}")
            if r.num_computed_tokens > sched.max_model_len:
                _fail("max_model_len", f"request {rid!r} goes past max_model_len: {r!r}")
            table = tables[rid]
            if len(table) * bs < r.num_computed_tokens:
                _fail("kv slots", f"request {rid!r} has {len(table)} blocks for "
                      f"{r.num_computed_tokens} tokens")
            blocks = kv.get_blocks(rid)
            for b in blocks:
                if b.ref_cnt <= 0 or b.prev_free is not None:
                    _fail("blocks", f"request {rid!r} uses block {b.block_id} that is free")
            held = [b.block_id for b in blocks]
            if len(held) != len(table) or (rid in new_ids and held != table):
                _fail("block table", f"request {rid!r}: worker blocks {table} vs KV manager {held}")
        if total != out.total_num_scheduled_tokens:
            _fail("tokens", f"total_num_scheduled_tokens {out.total_num_scheduled_tokens} != {total}")
        if total > sched.max_num_scheduled_tokens:
            _fail("budget", f"{total} tokens scheduled over a budget of "
                  f"{sched.max_num_scheduled_tokens}")
        # 5. The scheduler's ledger must mirror the worker model.
        if sched.slot_ledger.holders != tables.keys():
            _fail("ledger", f"ledger {sorted(sched.slot_ledger.holders)} != worker model "
                  f"{sorted(tables)}")
        for r in sched.running:
            if r.request_id not in tables:
                _fail("running holds slot", f"running request {r.request_id!r} has no slot")
        self.lora.on_schedule(out)
        if sched.sessions.idle:
            self._check_idle_slots(out)
        if self.num_steps % self.full_block_scan_every == 0:
            self.check_blocks()
        self.check_grammars()

    def _check_drafts(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        spec = sched.spec
        k = spec.k if spec is not None else 0
        kv = sched.kv_cache_manager
        for rid, d in out.scheduled_spec_decode_tokens.items():
            n = out.num_scheduled_tokens.get(rid)
            if n is None or not d or len(d) > k:
                _fail("drafts", f"request {rid!r}: {len(d)} drafts (k={k}) with {n} tokens "
                      "scheduled")
            assert n is not None
            r = sched.requests[rid]
            # The optimistic advance has run: computed = the request's tokens + its drafts.
            if n != 1 + len(d) or r.num_computed_tokens != r.num_tokens + len(d):
                _fail("drafts", f"request {rid!r}: {len(d)} drafts but {n} tokens scheduled "
                      f"for {r!r} (a draft step verifies the last token and its drafts)")
            if kv.num_cached_block.get(rid, 0) * sched.block_size > r.num_tokens:
                _fail("draft hashed", f"request {rid!r}: {kv.num_cached_block[rid]} blocks "
                      f"hashed, past its {r.num_tokens} accepted tokens")

    def on_update(self, out: SchedulerOutput) -> None:
        """After update_from_output: a verified request rolled its rejected drafts back."""
        requests = self.scheduler.requests
        for rid in out.scheduled_spec_decode_tokens:
            r = requests.get(rid)
            if (r is not None and r.status == RequestStatus.RUNNING
                    and r.num_computed_tokens != r.num_tokens - 1):
                _fail("draft rollback", f"request {rid!r} verified its drafts but computed "
                      f"{r.num_computed_tokens} of {r.num_tokens} tokens (rejected drafts must "
                      "roll back)")

    def check_grammars(self) -> None:
        """Every matcher advanced with exactly the tokens its request kept: none missed,
        none fed twice (a recompute after preemption), none left over (a session's fold)."""
        for rid, r in self.scheduler.requests.items():
            sor = r.structured_output_request
            if sor is None:
                continue
            consumed = sor.grammar.consumed_token_ids
            expected = sor.expected_token_ids(r.output_token_ids)
            if consumed != expected:
                _fail("grammar", f"request {rid!r}: its grammar consumed {len(consumed)} "
                      f"tokens {consumed[-8:]}..., but the request kept {len(expected)} "
                      f"{expected[-8:]}...")

    def _check_idle_slots(self, out: SchedulerOutput) -> None:
        sched = self.scheduler
        tables = self.block_tables
        sessions = sched.sessions
        holds_kv = sched.kv_cache_manager.holds_blocks
        cap = sched.scheduler_config.max_idle_sessions
        if cap is not None:
            holding = [rid for rid in sessions.idle if rid in tables or holds_kv(rid)]
            if len(holding) > cap:
                _fail("idle cap", f"{len(holding)} idle sessions keep a slot or KV "
                      f"({sorted(holding)}), over max_idle_sessions={cap}")
        if out.total_num_scheduled_tokens or not sched.waiting:
            return
        head = sched.waiting.peek_request()
        if head.request_id in tables or len(tables) < self.max_num_seqs:
            return
        grace = sched.scheduler_config.idle_slot_grace_s
        for rid, session in sessions.idle.items():
            # Re-derived here, not asked of the sessions component (which the scheduler asks).
            since = sessions.idle_since[rid]
            idle_for = sched.now - since
            overtaken = head.arrival_time < since and head.priority <= session.priority
            if rid in tables and (idle_for > grace or overtaken):
                why = (f"past the grace period of {grace:g} s" if idle_for > grace else
                       "and paused after that request began to wait")
                _fail("idle slot", f"request {head.request_id!r} waits for a worker slot while "
                      f"idle session {rid!r} has held one for {idle_for:g} s, {why}")

    def check_blocks(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
        if free + used != pool.num_usable_blocks:
            _fail("blocks", f"free {free} + used {used} != usable {pool.num_usable_blocks}")
        refs: dict[int, int] = {}
        for blocks in self.scheduler.kv_cache_manager.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            if b.ref_cnt != refs.get(b.block_id, 0):
                _fail("blocks", f"block {b.block_id} has ref_cnt {b.ref_cnt} but "
                      f"{refs.get(b.block_id, 0)} requests hold it")

    def check_worker_slots(self, slots: RequestSlots) -> None:
        """The real worker's table must hold exactly the modelled holders."""
        real = set(slots.req_id_to_index)
        if real != self.block_tables.keys():
            _fail("worker slots", f"worker holds {sorted(real)}, the model says "
                  f"{sorted(self.block_tables)}")

    def assert_drained(self) -> None:
        sched = self.scheduler
        if sched.requests:
            _fail("drain", f"requests left: {sorted(sched.requests)}")
        pool = sched.kv_cache_manager.block_pool
        if pool.get_num_free_blocks() != pool.num_usable_blocks:
            _fail("leak", f"{pool.num_usable_blocks - pool.get_num_free_blocks()} KV blocks "
                  "still in use after every request finished")
        if self.block_tables:
            _fail("leak", f"worker slots still held: {sorted(self.block_tables)}")
        if sched.slot_ledger.holders:
            _fail("leak", f"ledger still holds {sorted(sched.slot_ledger.holders)}")
        if self.lora.users or sched.lora_slots.adapter_of:
            _fail("leak", f"adapter slots still used by {sorted(self.lora.users)}")
        self.check_blocks()
