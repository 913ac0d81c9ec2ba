"""The adapter-slot ledger in the scheduler: at most max_loras adapters, slots change only when
unused (paused sessions count), waiting for a slot does not starve, hashes keyed by adapter."""

from __future__ import annotations

from slotserve.core.request import Request, RequestStatus
from slotserve.lora import LoRARequest
from slotserve.sampling_params import SamplingParams
from tests.helpers import EOS, Harness, make_scheduler

LORAS = [LoRARequest(f"a{i}", i, f"/nowhere/a{i}") for i in range(1, 5)]
STOP = 7


def req(rid: str, lora: LoRARequest | None, prompt: list[int] | None = None,
        max_tokens: int = 2, resumable: bool = False) -> Request:
    return Request(rid, prompt or [10, 11, 12, 13, 14], SamplingParams(
        max_tokens=max_tokens, stop_token_ids=[STOP], ignore_eos=True), eos_token_id=EOS,
        lora_request=lora, resumable=resumable)


def slots_of(d: Harness) -> dict[str, int]:
    return {rid: d.sched.lora_slots.slot(rid) for rid in d.sched.requests}


def test_third_adapter_waits_for_an_unused_slot() -> None:
    d = Harness(make_scheduler(block_size=4, max_loras=2))
    for rid, lora in (("a", LORAS[0]), ("b", LORAS[1]), ("c", LORAS[2]), ("base", None)):
        d.sched.add_request(req(rid, lora, max_tokens=2 if rid != "a" else 1))
    out, _ = d.step()
    # c waits: both slots are in use; the base request passes it.
    assert set(out.num_scheduled_tokens) == {"a", "b", "base"}
    assert {s: r.lora_int_id for s, r in out.lora_loads.items()} == {0: 1, 1: 2}
    assert {n.req_id: n.lora_slot for n in out.scheduled_new_reqs} == {"a": 0, "b": 1,
                                                                       "base": -1}
    # a finished: its adapter's slot (the least recently used unused one) goes to c.
    out, _ = d.step()
    assert "c" in out.num_scheduled_tokens and out.finished_req_ids == {"a"}
    assert {s: r.lora_int_id for s, r in out.lora_loads.items()} == {0: 3}
    d.run_until_idle()
    d.checker.assert_drained()


def test_a_paused_session_keeps_its_adapter_slot() -> None:
    d = Harness(make_scheduler(block_size=4, max_loras=1, idle_slot_grace_s=1e9))
    d.sched.add_request(req("s", LORAS[0], resumable=True))
    d.step(STOP)  # the session pauses holding its request slot, so its adapter's too
    assert d.sched.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    d.sched.add_request(req("x", LORAS[1]))
    d.sched.add_request(req("same", LORAS[0]))
    d.sched.add_request(req("base", None))
    out, _ = d.step()
    # x waits; the request behind it on the loaded adapter waits too (so slots drain).
    assert set(out.num_scheduled_tokens) == {"base"} and not out.lora_loads
    d.sched.add_request(req("s", None, resumable=False))  # the session ends
    out, _ = d.step()
    assert {s: r.lora_int_id for s, r in out.lora_loads.items()} == {0: 2}
    assert "x" in out.num_scheduled_tokens and "same" not in out.num_scheduled_tokens
    d.run_until_idle()
    d.checker.assert_drained()


def test_prefix_cache_is_keyed_by_adapter() -> None:
    d = Harness(make_scheduler(block_size=4, max_loras=2))
    prompt = list(range(20, 33))
    for rid, lora in (("p1", LORAS[0]), ("p2", LORAS[1]), ("p1b", LORAS[0]), ("b", None)):
        d.sched.add_request(req(rid, lora, prompt))
        d.run_until_idle()
    hits = d.sched.kv_cache_manager.prefix_cache_stats
    # Only p1b hits (p1's three full blocks); p2 and the base request compute everything.
    assert hits.hits == 12


def test_an_idle_session_past_its_grace_gives_its_adapter_slot_up() -> None:
    d = Harness(make_scheduler(block_size=4, max_loras=1, idle_slot_grace_s=0.0))
    d.sched.add_request(req("s", LORAS[0], resumable=True))
    d.step(STOP)
    d.sched.add_request(req("x", LORAS[1]))
    out, _ = d.step()
    # The session gave up its request slot and KV (it recomputes later), and so its adapter.
    assert out.preempted_req_ids == {"s"} and "x" in out.num_scheduled_tokens
    assert {s: r.lora_int_id for s, r in out.lora_loads.items()} == {0: 2}
    d.run_until_idle()
    d.sched.add_request(req("s", None, resumable=False))
    d.run_until_idle()
    d.checker.assert_drained()
