"""A recorded trace replays deterministically, with the checker on."""

from __future__ import annotations

import random
from pathlib import Path

from slotserve.check.events import STOP, Arrive, FailRequest, Schedule, Tick, Update
from slotserve.check.explore import ExploreConfig, write_trace
from slotserve.check.harness import Harness
from slotserve.check.trace import TraceRecorder, replay
from slotserve.core.outputs import ModelRunnerOutput
from slotserve.core.request import Request, RequestStatus
from slotserve.sampling_params import SamplingParams
from tests.helpers import make_request, make_scheduler, sample_for


def test_trace_replays_the_same_steps(tmp_path: Path) -> None:
    rng = random.Random(3)
    sched = make_scheduler(max_num_seqs=3, block_size=4, num_blocks=24,
                           max_num_batched_tokens=32, policy="priority")
    path = str(tmp_path / "t.jsonl")
    rec = TraceRecorder(path, sched.scheduler_config, sched.cache_config)
    steps = []
    for i in range(60):
        if rng.random() < 0.4:
            r = Request(f"r{i}", [rng.randint(10, 20) for _ in range(rng.randint(1, 20))],
                        SamplingParams(max_tokens=rng.randint(1, 8), stop_token_ids=[7]),
                        eos_token_id=2, priority=rng.randint(0, 2), arrival_time=float(i),
                        resumable=rng.random() < 0.3)
            sched.add_request(r)
            rec.add_request(r)
        if sched.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            rec.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if rng.random() < 0.05:
            rec.reset_prefix_cache(True)
            sched.reset_prefix_cache(True)
        out = sched.schedule()
        rec.schedule(out)
        ids = list(out.num_scheduled_tokens)
        sampled = [[rng.choice([7, 40, 41])] if sched.requests[i].num_computed_tokens
                   >= sched.requests[i].num_tokens else [] for i in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        rec.update(out, mro)
        sched.update_from_output(out, mro)
        steps.append(dict(out.num_scheduled_tokens))
    rec.close()
    replayed, outs = replay(path)
    assert [dict(o.num_scheduled_tokens) for o in outs] == steps
    assert {k: r.all_token_ids for k, r in replayed.requests.items()} == {
        k: r.all_token_ids for k, r in sched.requests.items()}


def test_idle_timeout_replays_at_the_same_step(tmp_path: Path) -> None:
    """Time enters the scheduler as `now` and the trace records it, so a replay, whenever it
    runs, ends an idle session at the step where the recorded run ended it."""
    sched = make_scheduler(block_size=4, streaming_session_timeout_s=30.0)
    path = str(tmp_path / "t.jsonl")
    rec = TraceRecorder(path, sched.scheduler_config, sched.cache_config)
    for r in (make_request("s", [11, 12, 13], max_tokens=2, ignore_eos=True, resumable=True),
              make_request("busy", 4, max_tokens=40, ignore_eos=True)):
        sched.add_request(r)
        rec.add_request(r)
    released = []
    for step in range(12):
        now = 1000.0 + 10.0 * step  # ten seconds a step: the session idles past 30 s
        out = sched.schedule(now=now)
        rec.schedule(out, now)
        mro = sample_for(sched, out)
        rec.update(out, mro)
        sched.update_from_output(out, mro)
        released.append(sorted(out.finished_req_ids))
    rec.close()
    idle_from = next(i for i, ids in enumerate(released) if ids == ["s"])
    assert idle_from >= 5  # stopped at step 1, idle for more than 30 s by step 5
    replayed, outs = replay(path)
    assert [sorted(o.finished_req_ids) for o in outs] == released
    assert "s" not in replayed.requests and "busy" in replayed.requests


def test_failed_requests_and_idle_slot_reclaim_replay(tmp_path: Path) -> None:
    """Issue 11's transitions replay from a trace: a request the worker failed alone (the
    `failed` field of its update), and an idle session whose slot a waiting request takes
    past the grace period (a clock the trace records), with logit_bias in the params."""
    cfg = ExploreConfig(max_num_seqs=2, num_blocks=8, idle_slot_grace_s=2.0)
    events = [Arrive((1, 3, 1), 2, resumable=True), Arrive((1, 3), 2), Schedule(),
              FailRequest(1), Arrive((1, 3, 3), 2), Schedule(), Update(((STOP,), (1,))),
              Arrive((3, 3), 2), Tick(3.0), Schedule()]
    h = Harness(cfg.scheduler())
    for e in events:
        h.apply(e)
    assert h.sched.sessions.num_slots_reclaimed == 1
    path = str(tmp_path / "t.jsonl")
    write_trace(cfg, events, path)
    sched, outs = replay(path)
    assert "r2" not in sched.requests  # failed alone
    assert outs[-1].preempted_req_ids == {"r1"}  # the idle session's slot, taken
    assert sorted(sched.slot_ledger.holders) == sorted(h.sched.slot_ledger.holders)
    params = SamplingParams(logit_bias={5: 1.5})
    rec = TraceRecorder(str(tmp_path / "b.jsonl"), sched.scheduler_config, sched.cache_config)
    rec.add_request(Request("b", [1, 2], params))
    rec.close()
    replayed, _ = replay(str(tmp_path / "b.jsonl"))
    assert replayed.requests["b"].sampling_params.logit_bias == {5: 1.5}
