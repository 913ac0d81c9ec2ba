"""Idle sessions keep their worker slot only within bounds (issue 11): past the grace period a
waiting request takes the slot of the least important, longest-idle session (a preemption the
worker is told about; the session keeps its tokens and recomputes them on its next chunk), and
at most max_idle_sessions idle sessions keep slot and KV at all.

The seed's own regression test (a newcomer waits while a session has just paused) is
tests/core/test_worker_slot_overflow.py::test_streaming_pause_does_not_over_admit_worker_slot,
unchanged: within the grace period the newcomer still waits.
"""

from __future__ import annotations

import pytest

from slotserve.check import InvariantChecker
from slotserve.core.request import Request, RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.errors import ConfigError, InvariantViolation
from slotserve.sampling_params import SamplingParams
from tests.helpers import bounded, make_request, make_scheduler, sample_for

STOP = 7
IDLE = RequestStatus.WAITING_FOR_STREAMING_REQ


def chunk(rid: str, tokens: list[int], max_tokens: int = 4, priority: int = 0,
          arrival_time: float | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP]),
                   eos_token_id=2, resumable=True, priority=priority,
                   arrival_time=arrival_time)


class Clocked:
    """Scheduler + checker + fake model, driven with an explicit clock."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.checker = InvariantChecker(sched)
        self.now = 0.0

    def step(self, token: int | dict[str, int] = 42):  # noqa: ANN201
        out = self.sched.schedule(now=self.now)
        self.checker.on_schedule(out)
        outs = self.sched.update_from_output(out, sample_for(self.sched, out, token),
                                             now=self.now)
        return out, outs

    def pause(self, rid: str, tokens: list[int], **kw: object) -> None:
        """A session runs its first chunk to a stop and goes idle at the current time."""
        self.sched.add_request(chunk(rid, tokens, arrival_time=self.now, **kw))  # type: ignore[arg-type]
        for _ in range(10):
            self.step({rid: STOP})
            if rid in self.sched.sessions.idle:
                return
        raise AssertionError(f"{rid} did not go idle")


def test_newcomer_takes_the_slot_only_after_the_grace_period() -> None:
    d = Clocked(make_scheduler(max_num_seqs=1, block_size=4, idle_slot_grace_s=2.0))
    d.pause("s", [1, 2, 3, 4, 5])
    d.sched.add_request(make_request("x", 4, start=300, arrival_time=0.5))
    d.now = 1.9  # within the grace period: the seed's semantics, x waits
    out, _ = d.step()
    assert not out.scheduled_new_reqs and d.checker.holders == {"s"}
    d.now = 2.5
    out, _ = d.step()
    # The session's slot and KV go to x, reported to the worker as a preemption.
    assert out.preempted_req_ids == {"s"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["x"]
    assert d.checker.holders == {"x"}
    s = d.sched.requests["s"]
    assert s.status == IDLE and s.num_computed_tokens == 0
    assert s.all_token_ids == [1, 2, 3, 4, 5, STOP]  # tokens kept
    assert not d.sched.kv_cache_manager.holds_blocks("s")
    stats = d.sched.make_stats()
    assert stats.num_idle_slots_reclaimed == 1 and stats.num_preemptions == 1
    # x finishes; the session's next chunk recomputes what it held (its first full block
    # is still cached) and completes.
    for _ in bounded(lambda: "x" in d.sched.requests):
        d.step()
    d.step()
    d.sched.add_request(chunk("s", [9], max_tokens=1, arrival_time=d.now))
    out, outs = d.step()
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "s" and new.prefill_token_ids == [1, 2, 3, 4, 5, 9]
    assert new.num_computed_tokens == 4 and out.num_scheduled_tokens == {"s": 2}
    assert outs[0].new_token_ids == [42] and outs[0].finish_reason == "length"


def test_a_request_waiting_before_the_pause_takes_the_slot_at_once() -> None:
    # The grace period protects a session against newcomers, not against a request that was
    # already waiting while the session ran: that one was there first.
    d = Clocked(make_scheduler(max_num_seqs=1, idle_slot_grace_s=60.0))
    d.sched.add_request(chunk("s", [1, 2, 3, 4, 5], arrival_time=0.0))
    d.step()  # s prefills and holds the only slot
    d.now = 0.1
    d.sched.add_request(make_request("x", 4, start=300, max_tokens=2, arrival_time=0.1))
    d.now = 0.2
    out, _ = d.step({"s": STOP})  # s pauses at 0.2; x has waited since 0.1
    assert "s" in d.sched.sessions.idle
    d.now = 0.3  # well within the grace period
    out, _ = d.step()
    assert out.preempted_req_ids == {"s"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["x"]
    assert d.checker.holders == {"x"}
    # The session's next chunk recomputes and runs; y arrives while it does, z after its
    # second pause: y takes the slot at once, z (a newcomer to the pause) waits.
    for _ in bounded(lambda: "x" in d.sched.requests):
        d.step()
    d.sched.add_request(chunk("s", [6], max_tokens=4, arrival_time=d.now))
    d.step()
    d.now = 0.4
    d.sched.add_request(make_request("y", 4, start=400, max_tokens=2, arrival_time=0.4))
    d.now = 0.5
    for _ in bounded(lambda: "s" not in d.sched.sessions.idle):
        d.step({"s": STOP})
    d.now = 0.6
    d.sched.add_request(make_request("z", 4, start=500, max_tokens=2, arrival_time=0.6))
    out, _ = d.step()
    assert out.preempted_req_ids == {"s"} and d.checker.holders == {"y"}
    assert [r.request_id for r in d.sched.waiting] == ["z"]


def test_a_less_important_earlier_waiter_still_waits_out_the_grace() -> None:
    d = Clocked(make_scheduler(max_num_seqs=1, policy="priority", idle_slot_grace_s=2.0))
    d.sched.add_request(chunk("s", [1, 2, 3], priority=0, arrival_time=0.0))
    d.step()
    d.now = 0.1
    d.sched.add_request(make_request("x", 4, start=300, priority=5, arrival_time=0.1))
    d.now = 0.2
    d.step({"s": STOP})
    d.now = 1.0
    out, _ = d.step()
    assert not out.preempted_req_ids and d.checker.holders == {"s"}
    d.now = 2.5
    out, _ = d.step()
    assert out.preempted_req_ids == {"s"} and d.checker.holders == {"x"}


def test_checker_catches_a_slot_kept_from_an_earlier_waiter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slotserve.core.sessions.StreamingSessions.slot_for_waiting",
                        lambda self, now, holds, waiter: None)
    d = Clocked(make_scheduler(max_num_seqs=1, idle_slot_grace_s=60.0))
    d.sched.add_request(chunk("s", [1, 2, 3], arrival_time=0.0))
    d.step()
    d.now = 0.1
    d.sched.add_request(make_request("x", 3, start=300, arrival_time=0.1))
    d.now = 0.2
    with pytest.raises(InvariantViolation, match=r"\[idle slot\].*'x'.*'s'.*paused after"):
        d.step({"s": STOP})
        d.step()


def test_the_least_important_then_longest_idle_session_gives_way() -> None:
    d = Clocked(make_scheduler(max_num_seqs=3, policy="priority", idle_slot_grace_s=1.0))
    d.pause("a", [1, 2, 3], priority=0)
    d.now = 1.0
    d.pause("b", [4, 5, 6], priority=1)  # less important: goes first
    d.now = 2.0
    d.pause("c", [7, 8, 9], priority=1)
    d.now = 10.0
    for i, expect in enumerate(["b", "c", "a"]):
        d.sched.add_request(make_request(f"x{i}", 3, start=300 + 10 * i, max_tokens=50,
                                         ignore_eos=True, arrival_time=d.now))
        out, _ = d.step()
        assert out.preempted_req_ids == {expect}, (i, out.preempted_req_ids)
    assert d.checker.holders == {"x0", "x1", "x2"}
    assert set(d.sched.sessions.idle) == {"a", "b", "c"}


def test_no_waiting_request_no_reclaim() -> None:
    d = Clocked(make_scheduler(max_num_seqs=2, idle_slot_grace_s=0.0))
    d.pause("s", [1, 2, 3])
    d.now = 100.0
    out, _ = d.step()
    assert not out.preempted_req_ids and d.checker.holders == {"s"}
    # A newcomer with a free slot takes the free one.
    d.sched.add_request(make_request("x", 3, start=300))
    out, _ = d.step()
    assert not out.preempted_req_ids and d.checker.holders == {"s", "x"}


def test_cap_on_idle_sessions_holding_slot_and_kv() -> None:
    d = Clocked(make_scheduler(max_num_seqs=4, max_idle_sessions=1, idle_slot_grace_s=60.0))
    d.pause("a", [1, 2, 3])
    d.now = 1.0
    d.pause("b", [4, 5, 6])
    # b's stop made two idle sessions; the next step takes the longer-idle one's slot and KV.
    out, _ = d.step()
    assert out.preempted_req_ids == {"a"} and d.checker.holders == {"b"}
    assert set(d.sched.sessions.idle) == {"a", "b"}
    assert d.sched.make_stats().num_idle_slots_reclaimed == 1
    # a resumes by recomputing; then b is the longest idle beyond the cap.
    d.sched.add_request(chunk("a", [10], max_tokens=1, arrival_time=d.now))
    _, outs = d.step()
    assert outs[0].finish_reason == "length"
    out, _ = d.step()
    assert out.preempted_req_ids == {"b"} and d.checker.holders == {"a"}


def test_cap_zero_keeps_nothing_for_idle_sessions() -> None:
    d = Clocked(make_scheduler(max_num_seqs=2, max_idle_sessions=0))
    d.pause("s", [1, 2, 3])
    out, _ = d.step()
    assert out.preempted_req_ids == {"s"} and not d.checker.holders
    assert d.sched.kv_cache_manager.block_pool.get_usage() == 0.0


def test_checker_catches_a_slot_held_past_the_grace_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slotserve.core.sessions.StreamingSessions.slot_for_waiting",
                        lambda self, now, holds, waiter: None)
    d = Clocked(make_scheduler(max_num_seqs=1, idle_slot_grace_s=1.0))
    d.pause("s", [1, 2, 3])
    d.sched.add_request(make_request("x", 3, start=300))
    d.now = 0.5
    d.step()  # within the grace period: waiting is right
    d.now = 5.0
    with pytest.raises(InvariantViolation, match=r"\[idle slot\].*'x'.*'s'"):
        d.step()


def test_checker_catches_too_many_idle_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slotserve.core.sessions.StreamingSessions.over_cap",
                        lambda self, holds: [])
    d = Clocked(make_scheduler(max_num_seqs=3, max_idle_sessions=1))
    d.pause("a", [1, 2, 3])
    with pytest.raises(InvariantViolation, match=r"\[idle cap\]"):
        d.pause("b", [4, 5, 6])
        d.step()


@pytest.mark.parametrize("bad", [{"idle_slot_grace_s": -1.0},
                                 {"idle_slot_grace_s": float("inf")},
                                 {"streaming_session_timeout_s": float("nan")},
                                 {"max_idle_sessions": -1}])
def test_bad_settings_are_config_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        make_scheduler(**bad)
