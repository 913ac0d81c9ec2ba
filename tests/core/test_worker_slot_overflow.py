"""The three regression tests from vLLM's slot-overflow bug report, against slotserve.

Each drives the scheduler with the checker's reference model of the worker's slot table; the
vLLM bug showed up as `AssertionError: No free indices` in that table.
"""

from __future__ import annotations

from slotserve.check import InvariantChecker
from slotserve.core.request import RequestStatus
from tests.helpers import make_request, make_scheduler, runner_output


def test_streaming_pause_does_not_over_admit_worker_slot() -> None:
    sched = make_scheduler(max_num_seqs=1)
    worker = InvariantChecker(sched)
    sched.add_request(make_request("session", 4, max_tokens=16, stop_token_ids=[7],
                                   resumable=True))
    out = sched.schedule()
    worker.on_schedule(out)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["session"]
    sched.update_from_output(out, runner_output(["session"], [[7]]))
    assert sched.requests["session"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert sched.num_waiting_for_streaming_input == 1

    sched.add_request(make_request("other", 4))
    out = sched.schedule()
    worker.on_schedule(out)  # must not raise "No free indices"
    assert "other" not in {r.req_id for r in out.scheduled_new_reqs}
    assert [r.request_id for r in sched.waiting] == ["other"]


def test_reset_prefix_cache_priority_does_not_over_admit_worker_slot() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    worker = InvariantChecker(sched)
    sched.add_request(make_request("A", 4, max_tokens=100, ignore_eos=True, priority=10))
    out = sched.schedule()
    worker.on_schedule(out)
    sched.update_from_output(out, runner_output(["A"], [[42]]))
    assert sched.requests["A"].status == RequestStatus.RUNNING

    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert sched.requests["A"].status == RequestStatus.PREEMPTED

    sched.add_request(make_request("B", 4, priority=0))
    out = sched.schedule()
    assert "A" in out.preempted_req_ids
    assert "B" in {r.req_id for r in out.scheduled_new_reqs}
    worker.on_schedule(out)
    assert worker.holders == {"B"}


def test_reset_prefix_cache_same_step_resume_purges_then_re_adds() -> None:
    sched = make_scheduler(max_num_seqs=1)
    worker = InvariantChecker(sched)
    sched.add_request(make_request("A", 4, max_tokens=100, ignore_eos=True))
    out = sched.schedule()
    worker.on_schedule(out)
    sched.update_from_output(out, runner_output(["A"], [[42]]))

    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    a = sched.requests["A"]
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0

    out = sched.schedule()
    assert "A" in out.preempted_req_ids
    assert "A" in {r.req_id for r in out.scheduled_new_reqs}
    worker.on_schedule(out)
    assert worker.holders == {"A"}
