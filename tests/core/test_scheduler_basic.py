"""Budget, chunked prefill, prefix caching, preemption, stop conditions and aborts."""

from __future__ import annotations

import pytest

from slotserve.core.request import Request, RequestStatus
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import SamplingParams
from tests.helpers import EOS, Harness, bounded, make_request, make_scheduler, runner_output


def test_running_first_then_waiting_under_one_budget() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=100))
    h.sched.add_request(make_request("a", 60))
    h.sched.add_request(make_request("b", 60, start=500))
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 60, "b": 40}
    out, _ = h.step()
    # a decodes 1 token first, then b finishes its prefill with 20.
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]


def test_long_prefill_token_threshold() -> None:
    h = Harness(make_scheduler(long_prefill_token_threshold=16))
    h.sched.add_request(make_request("a", 40))
    sizes = [h.step()[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert sizes == [16, 16, 8]


def test_without_chunked_prefill_a_long_request_stops_admission() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=64, max_model_len=64,
                               enable_chunked_prefill=False))
    h.sched.add_request(make_request("a", 40))
    h.sched.add_request(make_request("b", 30, start=300))  # does not fit the 24 left
    h.sched.add_request(make_request("c", 10, start=600))  # would fit, but must not jump the queue
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 40}


def test_identical_prompts_share_blocks_in_one_step() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.sched.add_request(make_request("a", 10))
    h.sched.add_request(make_request("b", 10))
    out, _ = h.step()
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}
    assert new["b"].num_computed_tokens == 8
    assert new["a"].block_ids[:2] == new["b"].block_ids[:2]
    assert new["a"].block_ids[2] != new["b"].block_ids[2]


def test_full_prefix_hit_still_computes_one_token() -> None:
    h = Harness(make_scheduler(block_size=4))
    h.sched.add_request(make_request("a", 8, max_tokens=1))
    h.run_until_idle()
    h.sched.add_request(make_request("b", 8, max_tokens=1))
    out, outs = h.step()
    assert out.num_scheduled_tokens == {"b": 4}  # one block hit, not both
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert outs[0].new_token_ids == [42]


def test_fcfs_preempts_most_recent_and_it_resumes_with_its_outputs() -> None:
    # 6 usable blocks of 4 tokens; two requests of 8 tokens grow until the cache is full.
    h = Harness(make_scheduler(block_size=4, num_blocks=7))
    h.sched.add_request(make_request("a", 8, max_tokens=10, ignore_eos=True))
    h.sched.add_request(make_request("b", 8, max_tokens=10, ignore_eos=True, start=300))
    preempted_at = None
    for step in range(20):
        out, _ = h.step()
        if out.preempted_req_ids:
            preempted_at = step
            break
    assert preempted_at is not None and out.preempted_req_ids == {"b"}
    b = h.sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens > 0
    assert next(iter(h.sched.waiting)) is b
    kept = list(b.all_token_ids)

    def b_not_back() -> bool:
        return "b" not in {r.req_id for r in out.scheduled_new_reqs}

    for _ in bounded(b_not_back):
        out, _ = h.step()
    new_b = next(r for r in out.scheduled_new_reqs if r.req_id == "b")
    assert new_b.prefill_token_ids == kept
    h.run_until_idle()
    h.checker.assert_drained()


def test_priority_preemption_evicts_worst_with_rollback() -> None:
    # "low" (priority 5) is admitted first, "high" (priority 0) second; when high needs a
    # block, low is evicted even though it was already scheduled in this step.
    h = Harness(make_scheduler(block_size=4, num_blocks=5, policy="priority"))
    h.sched.add_request(make_request("low", 5, max_tokens=20, ignore_eos=True, priority=5,
                                     arrival_time=1.0))
    h.step()
    h.sched.add_request(make_request("high", 7, max_tokens=20, ignore_eos=True, priority=0,
                                     arrival_time=2.0, start=300))
    out, _ = h.step()
    assert {r.req_id for r in out.scheduled_new_reqs} == {"high"}
    # Both hold 2 of the 4 blocks. low (admitted first, so visited first) still has room when
    # high needs a third block: low is evicted after it was scheduled, and rolled back.
    for _ in range(4):
        out, _ = h.step()
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.scheduled_cached_reqs.req_ids == ["high"]
    assert h.sched.requests["low"].status == RequestStatus.PREEMPTED


def test_preempted_request_hits_its_own_prefix_on_resume() -> None:
    h = Harness(make_scheduler(block_size=4, num_blocks=64))
    h.sched.add_request(make_request("a", 12, max_tokens=10, ignore_eos=True))
    h.step()
    h.step()
    assert h.sched.reset_prefix_cache(reset_running_requests=True) is True
    # The reset cleared the hash map, so run once more to cache, then preempt by reset again
    # without clearing: preempt through the scheduler path instead.
    out, _ = h.step()
    a = h.sched.requests["a"]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    h.step()
    h.sched.running.remove(a)
    h.sched._preempt_request(a)
    expected_hit = (a.num_tokens - 1) // 4 * 4
    out, _ = h.step()
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "a" and "a" in out.preempted_req_ids
    assert new.num_computed_tokens == expected_hit == 12


def test_stop_conditions() -> None:
    sched = make_scheduler()
    cases = {
        "eos": (dict(), [[5, EOS, 9]], "stop", None, [5, EOS]),
        "stop_tok": (dict(stop_token_ids=[9]), [[9, 4]], "stop", 9, [9]),
        "length": (dict(max_tokens=2), [[5, 6, 7]], "length", None, [5, 6]),
        # Below min_tokens the stop token is ignored; the EOS after it counts.
        "min_tokens": (dict(min_tokens=2, stop_token_ids=[9]), [[9, EOS, 9]], "stop", None,
                       [9, EOS]),
        "min_tokens_stop": (dict(min_tokens=1, stop_token_ids=[9]), [[9, 9]], "stop", 9, [9]),
        "ignore_eos": (dict(ignore_eos=True, max_tokens=3), [[EOS, EOS, EOS]], "length", None,
                       [EOS, EOS, EOS]),
    }
    for rid, (kw, sampled, reason, stop_reason, tokens) in cases.items():
        sched.add_request(make_request(rid, 4, **kw))
        out = sched.schedule()
        outs = sched.update_from_output(out, runner_output([rid], sampled))
        assert len(outs) == 1, rid
        assert outs[0].finish_reason == reason, rid
        assert outs[0].stop_reason == stop_reason, rid
        assert outs[0].new_token_ids == tokens, rid
        assert outs[0].finished and rid not in sched.requests


def test_max_model_len_caps_length() -> None:
    h = Harness(make_scheduler(max_model_len=10))
    h.sched.add_request(make_request("a", 8, max_tokens=100, ignore_eos=True))
    h.step()
    _, outs = h.step()
    assert outs[0].finish_reason == "length" and outs[0].finished


def test_abort_releases_in_a_step_that_schedules_nothing() -> None:
    h = Harness(make_scheduler())
    h.sched.add_request(make_request("a", 20, max_tokens=50, ignore_eos=True))
    h.step()
    h.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert h.sched.has_requests() and not h.sched.has_unfinished_requests()
    out, _ = h.step()
    assert out.finished_req_ids == {"a"} and out.total_num_scheduled_tokens == 0
    out, _ = h.step()
    assert out.finished_req_ids == set()  # delivered exactly once
    h.checker.assert_drained()


def test_pipelined_schedules_and_late_output_for_preempted_request() -> None:
    h = Harness(make_scheduler())
    h.sched.add_request(make_request("a", 6, max_tokens=20, ignore_eos=True))
    first = h.schedule()
    second = h.schedule()  # a's decode is in flight: nothing new for it
    assert first.num_scheduled_tokens == {"a": 6} and second.num_scheduled_tokens == {}
    h.sched.reset_prefix_cache(reset_running_requests=True)
    h.sched.update_from_output(first, runner_output(["a"], [[77]]))
    h.sched.update_from_output(second, runner_output([], []))
    a = h.sched.requests["a"]
    assert a.status == RequestStatus.PREEMPTED and a.output_token_ids == [77]
    out = h.schedule()
    assert out.scheduled_new_reqs[0].prefill_token_ids[-1] == 77


def test_bad_input_raises_and_changes_nothing() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    before = (dict(sched.requests), len(sched.waiting))
    with pytest.raises(RequestValidationError):
        sched.add_request(make_request("empty", []))
    with pytest.raises(RequestValidationError):
        Request("x", [1, "2"], SamplingParams())  # type: ignore[list-item]
    with pytest.raises(RequestValidationError):
        Request("x", [1, -2], SamplingParams())
    with pytest.raises(RequestValidationError):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestValidationError):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestValidationError):
        SamplingParams(top_p=0)
    with pytest.raises(RequestValidationError):
        sched.add_request(make_request("a", 4))  # duplicate, not a session
    assert (dict(sched.requests), len(sched.waiting)) == before


def test_unfittable_prompts_finish_ignored() -> None:
    h = Harness(make_scheduler(max_model_len=32, block_size=4, num_blocks=5))
    h.sched.add_request(make_request("long", 40))
    h.sched.add_request(make_request("kv", 20))  # needs 6 blocks, 4 usable
    h.sched.add_request(make_request("ok", 4, max_tokens=1, start=300))
    out, outs = h.step()
    by_id = {o.request_id: o for o in outs}
    assert by_id["long"].finish_reason == "length" and by_id["long"].finished
    assert "max_model_len" in (by_id["long"].finish_message or "")
    assert "KV" in (by_id["kv"].finish_message or "")
    assert by_id["ok"].new_token_ids == [42]
    h.run_until_idle()
    h.checker.assert_drained()


def test_request_grown_past_the_cache_by_a_late_output_does_not_block_the_queue() -> None:
    # Found by the fuzzer: 3 usable blocks of 2 tokens; "a" (6 tokens) is preempted by a
    # reset while its step is in flight, and the late token makes it 7 tokens long.
    h = Harness(make_scheduler(max_num_seqs=1, block_size=2, num_blocks=4,
                               enable_prefix_caching=False))
    h.sched.add_request(make_request("a", 5, max_tokens=6, ignore_eos=True))
    h.step()
    first = h.schedule()
    h.sched.reset_prefix_cache(reset_running_requests=True)
    h.sched.update_from_output(first, runner_output(["a"], [[42]]))
    assert h.sched.requests["a"].num_tokens == 7
    h.sched.add_request(make_request("b", 2, max_tokens=1, start=300))
    out, outs = h.step()
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].finish_reason == "length" and by_id["a"].finished
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    h.run_until_idle()
    h.checker.assert_drained()


def test_failed_step_uncaches_the_blocks_it_scheduled() -> None:
    # The engine finishes a failed step's requests with FINISHED_ERROR; their blocks were
    # cached at scheduling time but never written, so nobody may hit them afterwards.
    h = Harness(make_scheduler(block_size=4))
    h.sched.add_request(make_request("a", 9))
    h.schedule()
    h.sched.finish_requests("a", RequestStatus.FINISHED_ERROR)
    assert h.sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    h.sched.add_request(make_request("b", 9))
    out, _ = h.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
