"""Streaming-input sessions: pause, promotion, slot windows, liveness under KV pressure."""

from __future__ import annotations

from slotserve.core.request import Request, RequestStatus
from slotserve.sampling_params import SamplingParams
from tests.helpers import (
    EOS,
    Harness,
    make_request,
    make_scheduler,
    runner_output,
)

STOP = 7
PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ


def chunk(rid: str, tokens: list[int], max_tokens: int = 16, resumable: bool = True,
          priority: int = 0, arrival_time: float | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP]),
                   eos_token_id=EOS, resumable=resumable, priority=priority,
                   arrival_time=arrival_time)


def test_chunk_fold_matches_vllm_example() -> None:
    d = Harness(make_scheduler(block_size=4))
    d.sched.add_request(chunk("s", [1, 2, 3]))
    d.step(10)
    out, outs = d.step(STOP)
    assert outs[0].finish_reason == "stop" and not outs[0].finished
    s = d.sched.requests["s"]
    assert s.status == PAUSED and s.num_computed_tokens == 4
    d.sched.add_request(chunk("s", [4, 5]))
    assert s.all_token_ids == [1, 2, 3, 10, 4, 5] and s.prompt_token_ids == [1, 2, 3, 10, 4, 5]
    assert s.num_computed_tokens == 4 and s.output_token_ids == []
    out = d.schedule()
    assert out.num_scheduled_tokens == {"s": 2}
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "s" and new.num_computed_tokens == 4
    assert new.block_ids == d.sched.kv_cache_manager.get_block_ids("s")
    assert new.prefill_token_ids == [1, 2, 3, 10, 4, 5]


def test_per_chunk_sampling_params_and_session_end() -> None:
    d = Harness(make_scheduler())
    d.sched.add_request(chunk("s", [1, 2, 3], max_tokens=2))
    d.step()
    _, outs = d.step()
    assert outs[0].finish_reason == "length" and not outs[0].finished
    d.sched.add_request(chunk("s", [4], max_tokens=1))
    _, outs = d.step()
    assert outs[0].new_token_ids == [42] and outs[0].finish_reason == "length"
    # A non-resumable request with the same id ends a paused session at once.
    d.sched.add_request(chunk("s", [0], resumable=False))
    assert "s" not in d.sched.requests
    out, outs = d.step()
    assert out.finished_req_ids == {"s"}
    assert outs[0].finished and outs[0].finish_reason == "abort"
    d.checker.assert_drained()


def test_end_marker_while_running_ends_session_at_its_stop() -> None:
    d = Harness(make_scheduler())
    d.sched.add_request(chunk("s", [1, 2, 3], max_tokens=3))
    d.step()
    d.sched.add_request(chunk("s", [0], resumable=False))
    assert d.sched.requests["s"].status == RequestStatus.RUNNING
    d.step()
    _, outs = d.step()
    assert outs[0].finished and outs[0].finish_reason == "length"
    d.step()
    d.checker.assert_drained()


def test_zero_token_continuation_recomputes_last_token() -> None:
    d = Harness(make_scheduler(block_size=4))
    d.sched.add_request(chunk("s", [1, 2, 3, 4]))
    d.step(10)
    d.step(STOP)
    d.sched.add_request(chunk("s", []))
    s = d.sched.requests["s"]
    assert s.all_token_ids == [1, 2, 3, 4, 10] and s.num_computed_tokens == 4
    out, outs = d.step(11)
    assert out.num_scheduled_tokens == {"s": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert outs[0].new_token_ids == [11]


def test_window_session_stops_with_next_chunk_queued() -> None:
    d = Harness(make_scheduler(max_num_seqs=2))
    d.sched.add_request(make_request("a", 4, max_tokens=50, ignore_eos=True))
    d.sched.add_request(chunk("s", [1, 2, 3]))
    d.step()
    d.sched.add_request(make_request("x", 4, start=300))
    d.sched.add_request(chunk("s", [4, 5]))  # queued while s runs
    out, _ = d.step({"s": STOP})
    assert d.sched.requests["s"].status == RequestStatus.WAITING  # promoted, holds its slot
    out = d.schedule()  # the worker model raises on overflow
    assert "s" in {r.req_id for r in out.scheduled_new_reqs}
    assert "x" not in out.num_scheduled_tokens
    assert d.checker.holders == {"a", "s"}


def test_window_resumed_session_overtaken_by_higher_priority() -> None:
    d = Harness(make_scheduler(max_num_seqs=1, policy="priority"))
    d.sched.add_request(chunk("s", [1, 2, 3], priority=5, arrival_time=1.0))
    d.step(STOP)
    d.sched.add_request(chunk("s", [4], priority=5, arrival_time=2.0))
    d.sched.add_request(make_request("x", 4, priority=0, arrival_time=3.0))
    out = d.schedule()
    # x is first by priority but has no slot to take; the session, which holds one, goes.
    assert [r.req_id for r in out.scheduled_new_reqs] == ["s"]
    assert d.checker.holders == {"s"}


def test_liveness_paused_session_holding_every_block() -> None:
    d = Harness(make_scheduler(max_num_seqs=2, block_size=4, num_blocks=5))
    d.sched.add_request(chunk("s", list(range(1, 15))))  # 14 tokens: all 4 blocks
    d.step(STOP)
    assert d.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    d.sched.add_request(make_request("x", 6, max_tokens=2, start=300))
    out, _ = d.step()
    assert out.preempted_req_ids == {"s"}  # its KV reclaimed, reported to the worker
    assert [r.req_id for r in out.scheduled_new_reqs] == ["x"]
    d.run_until_idle()
    # The session resumes later by recomputing what its old blocks no longer cache: x took
    # two of them, the two leading ones still hold its first 8 tokens.
    d.sched.add_request(chunk("s", [20], max_tokens=1))
    out, outs = d.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"s": 7}
    assert outs[0].new_token_ids == [42]


def test_liveness_two_resumed_sessions_each_holding_part() -> None:
    d = Harness(make_scheduler(max_num_seqs=2, block_size=4, num_blocks=5))
    d.sched.add_request(chunk("a", [1, 2, 3, 4, 5, 6], arrival_time=1.0))
    d.sched.add_request(chunk("b", [11, 12, 13, 14, 15, 16], arrival_time=2.0))
    d.step(STOP)
    assert d.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    d.sched.add_request(chunk("a", [7, 8, 9, 10], max_tokens=1))  # each needs a third block
    d.sched.add_request(chunk("b", [17, 18, 19, 20], max_tokens=1))
    out, _ = d.step()
    assert out.preempted_req_ids == {"b"}  # the more recent one gives way
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    for _ in range(50):
        if not d.sched.waiting and not d.sched.running:
            break
        d.step()
    # Both chunks completed: b after reclaiming the paused a's KV in turn.
    assert set(d.sched.sessions.idle) == {"a", "b"}
    assert all(len(d.sched.requests[r].output_token_ids) == 1 for r in "ab")


def test_reset_prefix_cache_reclaims_paused_session() -> None:
    d = Harness(make_scheduler())
    d.sched.add_request(chunk("s", [1, 2, 3]))
    d.step(STOP)
    assert d.sched.reset_prefix_cache(reset_running_requests=True) is True
    out = d.schedule()
    assert out.preempted_req_ids == {"s"} and d.checker.holders == set()
    assert d.sched.requests["s"].status == PAUSED


def test_idle_session_times_out() -> None:
    d = Harness(make_scheduler(streaming_session_timeout_s=0.0))
    d.sched.add_request(chunk("s", [1, 2, 3]))
    d.step(STOP)
    out, outs = d.step()
    assert out.finished_req_ids == {"s"} and outs[0].finished
    assert "idle" in (outs[0].finish_message or "")
    d.checker.assert_drained()


def test_stopped_preempted_session_does_not_hold_a_slot() -> None:
    # A late output stops a session that was preempted in between (vLLM facts 11.4).
    d = Harness(make_scheduler(max_num_seqs=1))
    d.sched.add_request(chunk("s", [1, 2, 3]))
    first = d.schedule()
    d.sched.reset_prefix_cache(reset_running_requests=True)
    d.sched.update_from_output(first, runner_output(["s"], [[STOP]]))
    assert d.sched.requests["s"].status == PAUSED
    d.sched.add_request(make_request("x", 4, start=300))
    out = d.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["x"]
    assert d.checker.holders == {"x"}
