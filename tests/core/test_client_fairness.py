"""Fairness among clients in the FCFS queue (core/fairness.py): a free slot goes to the
waiting request of the client holding the fewest slots (FCFS within a client and on ties); with
no slot free, the client holding the most gives one up to a client holding at least two fewer;
requests without a client (offline use) keep plain FCFS. The invariant checker runs on every
step (Harness)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from slotserve.core.request import Request
from slotserve.sampling_params import SamplingParams
from tests.helpers import Harness, make_scheduler


def _request(rid: str, client: str | None, max_tokens: int = 4, start: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(rid, list(range(start, start + 8)), params, client=client)


def test_a_client_holding_none_preempts_the_client_holding_most() -> None:
    h = Harness(make_scheduler(max_num_seqs=4))
    for i in range(6):  # the burst: 4 run, 2 wait
        h.sched.add_request(_request(f"burst{i}", "user:burst", max_tokens=20))
    h.step()
    h.sched.add_request(_request("normal", "user:normal", start=500))
    out, _ = h.step()
    # The burst's latest admitted request gives its slot up at once (recompute).
    assert out.preempted_req_ids == {"burst3"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["normal"]
    out, _ = h.step()  # one slot each way is not unfair enough to swing back
    assert not out.preempted_req_ids and not out.scheduled_new_reqs
    h.run_until_idle()


def test_a_freed_slot_goes_to_the_client_holding_fewest() -> None:
    h = Harness(make_scheduler(max_num_seqs=3))
    h.sched.add_request(_request("a0", "user:a", max_tokens=20))
    h.sched.add_request(_request("b0", "user:b", max_tokens=20, start=200))
    h.sched.add_request(_request("c0", "user:c", max_tokens=3, start=300))
    h.step()
    h.sched.add_request(_request("a1", "user:a", start=400))  # a holds one: waits first
    h.sched.add_request(_request("d0", "user:d", start=500))  # d holds none: one fewer
    out, _ = h.step()
    assert not out.preempted_req_ids  # a gap of one: no preemption
    h.step()  # c0 ends (3 tokens)
    out, _ = h.step()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["d0"]
    h.run_until_idle()


def test_without_clients_the_queue_stays_fcfs() -> None:
    h = Harness(make_scheduler(max_num_seqs=4))
    for i in range(6):
        h.sched.add_request(_request(f"a{i}", None, max_tokens=2 + i))
    h.step()
    h.sched.add_request(_request("late", None, start=500))
    h.step()
    out, _ = h.step()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a4"]


def test_ties_go_in_arrival_order() -> None:
    h = Harness(make_scheduler(max_num_seqs=2))
    h.sched.add_request(_request("x0", "user:x", max_tokens=2))
    h.sched.add_request(_request("y0", "user:y", max_tokens=2))
    h.step()
    for rid, client in (("y1", "user:y"), ("x1", "user:x"), ("y2", "user:y")):
        h.sched.add_request(_request(rid, client, start=300))
    h.step()  # both end: each client holds none
    out, _ = h.step()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["y1", "x1"]


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 4),
       events=st.lists(st.tuples(st.sampled_from(["arrive", "step"]), st.integers(0, 3),
                                 st.integers(1, 4)), max_size=40))
def test_no_waiting_client_holding_fewer_is_passed_over(
        slots: int, events: list[tuple[str, int, int]]) -> None:
    """Whenever a request takes a fresh slot, every request still waiting belongs to a client
    that held at least as many slots as the taker's client did at that moment (so a client
    holding fewer is never passed over), and within a client the order is FCFS; a request
    preempted for fairness leaves its client holding more than the poorest waiting client;
    and everything finishes (no preemption swings back and forth)."""
    h = Harness(make_scheduler(max_num_seqs=slots))
    sched = h.sched
    n = 0
    for kind, client, max_tokens in events + [("step", 0, 0)] * 200:
        if kind == "arrive":
            sched.add_request(_request(f"r{n}", f"c{client}", max_tokens, start=100 + 9 * n))
            n += 1
            continue
        held: dict[str | None, int] = {}
        for r in sched.running:
            held[r.client] = held.get(r.client, 0) + 1
        waiting = list(sched.waiting)
        out, _ = h.step()
        for rid in out.preempted_req_ids:  # a fairness preemption: before admission
            victim = sched.requests[rid]
            held[victim.client] -= 1
            assert held[victim.client] >= min(held.get(r.client, 0) for r in waiting) + 1
        admitted = [r.req_id for r in out.scheduled_new_reqs]
        left = [r for r in waiting if r.request_id not in admitted]
        for rid in admitted:
            taker = next(r for r in waiting if r.request_id == rid)
            for r in left:
                assert held.get(r.client, 0) >= held.get(taker.client, 0), (rid, r)
                if r.client == taker.client:
                    assert int(r.request_id[1:]) > int(rid[1:])
            held[taker.client] = held.get(taker.client, 0) + 1
    assert not sched.has_unfinished_requests()
