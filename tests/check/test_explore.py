"""The exhaustive explorer: the CI bounds hold, mutations are found, traces replay, merges are
sound.

The CI exploration (2 slots, 3 usable blocks of 2 tokens, budget 6, prompts [1, 3, 1, 3],
max_tokens 2, sessions with one-token chunks, idle-slot grace periods and idle timeouts,
failed steps, up to two outputs in flight) covers every interleaving of up to 7 events under
FCFS and up to 6 under priority (priorities 0 and 1), with the checker and the worker's slot
table on every output and a drain from every distinct state. Empty chunks join the menu in the (shallower) merge check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slotserve.check.canonical import canonical_key
from slotserve.check.events import (
    STOP,
    TOKEN,
    Abort,
    Arrive,
    Menu,
    Schedule,
    Tick,
    Update,
)
from slotserve.check.explore import REQUIRED_EFFECTS, ExploreConfig, explore, main, write_trace
from slotserve.check.harness import Harness
from slotserve.check.trace import replay
from slotserve.core.scheduler import Scheduler
from slotserve.core.sessions import StreamingSessions
from slotserve.errors import InvariantViolation

CI_MENU = Menu(prompts=((1, 3, 1, 3),), chunks=((3,),), max_tokens=(2,), sessions=True,
               ticks=True, failures=True)
CI = ExploreConfig(max_num_seqs=2, num_blocks=4, block_size=2, max_num_batched_tokens=6,
                   menu=CI_MENU)
# What the CI bounds must reach (the README says so): the explorer's own required effects, and
# idle-KV reclaim, session timeouts and tokens that arrive after their request was preempted.
CI_EFFECTS = (*REQUIRED_EFFECTS, "idle KV reclaimed", "idle session timed out",
              "token after preemption")
CI_ARGS = ["--max-num-seqs", "2", "--num-blocks", "4", "--block-size", "2",
           "--max-num-batched-tokens", "6", "--prompts", "1313", "--chunks", "3",
           "--max-tokens", "2", "--sessions", "--failures"]


def _assert_clean(report, beyond_depth: tuple[str, ...] = ()) -> None:  # noqa: ANN001
    assert report.violation is None, report.summary()
    missing = [e for e in CI_EFFECTS if not report.effects[e] and e not in beyond_depth]
    assert not missing, f"not reached: {missing}\n{report.summary()}"
    assert report.drained == report.distinct - 1  # every state but the empty engine


def test_ci_exploration_fcfs_depth_7(capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    # Depth 7 reaches every CI effect (the rarest, a newcomer taking an idle session's slot,
    # needs 7 events: 6 states of 12,108); depth 8 reached no other effect, at 3.6x the CPU
    # time (50 s against 14 s, measured side by side on the loaded machine).
    assert main([*CI_ARGS, "--depth", "7", "--trace-out", str(tmp_path / "t.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "no violation, no wedge" in out
    assert "deepest new state at depth 7" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("states of interest: "))
    missing = [e for e in CI_EFFECTS if not re.search(rf"[:,] {re.escape(e)} [1-9]", line)]
    assert not missing, f"not reached: {missing}\n{out}"
    assert not (tmp_path / "t.jsonl").exists()


def test_ci_exploration_priority_depth_6() -> None:
    cfg = ExploreConfig(**{**_fields(CI), "policy": "priority", "depth": 6,
                           "menu": Menu(**{**_fields(CI_MENU), "priorities": (0, 1)})})
    report = explore(cfg)
    # A newcomer taking an idle session's slot needs 7 events (two sessions pause holding
    # both slots, a request arrives, the clock passes the grace period, a step): the FCFS
    # exploration reaches it.
    _assert_clean(report, beyond_depth=("idle session's slot taken",))
    assert report.deepest == 6 and report.distinct > 10_000


def test_merged_states_have_the_same_successors() -> None:
    # Every state merged into an earlier one is expanded as well and compared, event by
    # event, with the representative: same successor keys, same effects, same failures.
    # Empty session chunks (zero-token continuations) are in the menu here. Depth 4 each (185
    # and 787 merges; FCFS at depth 5 cost a minute more on the loaded CI machine): a key that
    # ignored the priority or the idle time was still caught.
    for policy, depth, priorities in (("fcfs", 4, (0,)), ("priority", 4, (0, 1))):
        menu = Menu(**{**_fields(CI_MENU), "priorities": priorities, "chunks": ((3,), ())})
        cfg = ExploreConfig(**{**_fields(CI), "policy": policy, "depth": depth, "menu": menu})
        report = explore(cfg, check_merges=True)
        assert report.violation is None, report.summary()
        assert report.merges_checked > 150


def test_isolated_request_failures_explored() -> None:
    # A step whose worker isolated a failure to one request: that request ends with an error
    # wherever it is (running, preempted meanwhile, a session), the rest of the step goes on.
    menu = Menu(**{**_fields(CI_MENU), "failures": False, "request_failures": True})
    report = explore(ExploreConfig(**{**_fields(CI), "depth": 6, "menu": menu}))
    assert report.violation is None, report.summary()
    assert report.effects["one request of a step failed"] > 100


def _fields(obj: object) -> dict[str, object]:
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- mutations
def _pre_fix_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM before the fix: admission counts only running requests, so paused sessions
    holding worker slots are not counted."""
    original = Scheduler._schedule_waiting

    def schedule_waiting(self: Scheduler, *args):  # noqa: ANN002, ANN202
        ledger = self.slot_ledger
        ledger.num_free_slots = lambda: self.max_num_running_reqs - len(self.running)
        try:
            return original(self, *args)
        finally:
            del ledger.num_free_slots

    monkeypatch.setattr(Scheduler, "_schedule_waiting", schedule_waiting)


def _drop_preempted_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preemption inside schedule() that is never reported to the worker."""
    original = Scheduler._preempt_request

    def preempt(self: Scheduler, request) -> None:  # noqa: ANN001
        original(self, request)
        self.preempted_req_ids.discard(request.request_id)

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt)


MUTATION_CFG = ExploreConfig(max_num_seqs=2, num_blocks=6, block_size=2,
                             max_num_batched_tokens=6, depth=7,
                             menu=Menu(prompts=((1, 3, 1),), max_tokens=(2,), sessions=True))


def _find_violation(cfg: ExploreConfig, trace: Path, capsys: pytest.CaptureFixture[str]
                    ) -> list[str]:
    """Explore, print the report as the CLI does, and return the violating events."""
    report = explore(cfg, str(trace))
    print(report.summary())
    v = report.violation
    assert v is not None and v.kind == "violation" and v.shortest, report.summary()
    out = capsys.readouterr().out
    assert f"VIOLATION after {len(v.events)} events" in out and str(trace) in out
    assert all(str(e) in out for e in v.events)
    return [str(e) for e in v.events]


def test_pre_fix_admission_rule_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _pre_fix_admission(monkeypatch)
    trace = tmp_path / "violation.jsonl"
    # Shortest: a session pauses holding its slot, one request runs, another arrives, and
    # admission takes a third slot.
    assert _find_violation(MUTATION_CFG, trace, capsys) == [
        "arrive [1, 3, 1] max_tokens=2", "arrive [1, 3, 1] max_tokens=2 (a session)",
        "schedule", "model answers: [1], stop", "arrive [1, 3, 1] max_tokens=2", "schedule"]
    # The trace replays to the same failure while the mutation is in place, and cleanly
    # on the real scheduler.
    with pytest.raises(AssertionError, match="slot ledger over capacity"):
        replay(str(trace))
    monkeypatch.undo()
    sched, outs = replay(str(trace))
    assert len(outs) == 2 and len(sched.slot_ledger.holders) == 2


def test_dropped_preempted_id_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _drop_preempted_id(monkeypatch)
    trace = tmp_path / "violation.jsonl"
    # Two identical prompts fill the cache (the second hits the first's block); the next
    # decode needs a block, so the later one is preempted.
    assert _find_violation(CI, trace, capsys) == [
        "arrive [1, 3, 1, 3] max_tokens=2", "arrive [1, 3, 1, 3] max_tokens=2", "schedule",
        "model answers: [1], [1]", "schedule"]
    with pytest.raises(InvariantViolation, match="ledger"):
        replay(str(trace))


def test_a_wedge_is_found_and_its_trace_shows_it(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    # Without reclaiming idle sessions' KV, a resumed session that holds the KV cache and a
    # preempted request ahead of it wait for each other forever.
    monkeypatch.setattr(Scheduler, "_idle_kv_holders", lambda self: [])
    trace = tmp_path / "wedge.jsonl"
    cfg = ExploreConfig(**{**_fields(CI), "depth": 6, "drain_steps": 20,
                           "menu": Menu(**{**_fields(CI_MENU), "resets": False})})
    report = explore(cfg, str(trace))
    v = report.violation
    assert v is not None and v.kind == "wedge", report.summary()
    assert "[wedge]" in v.error
    sched, outs = replay(str(trace))
    assert sched.requests and len(outs) >= 20  # the drain's steps: nothing finishes


def test_idle_slots_held_forever_are_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # The class of issue 11: slots counted correctly but held forever by idle sessions. With
    # the grace-period reclaim removed, the checker's idle-slot rule fires on the shortest
    # sequence: two sessions pause holding both slots, a request arrives, the clock passes
    # the grace period, and a step leaves it waiting.
    monkeypatch.setattr(StreamingSessions, "slot_for_waiting",
                        lambda self, now, holds, waiter: None)
    cfg = ExploreConfig(**{**_fields(MUTATION_CFG), "depth": 8,
                           "menu": Menu(**{**_fields(MUTATION_CFG.menu), "ticks": True})})
    events = _find_violation(cfg, tmp_path / "violation.jsonl", capsys)
    assert events == [
        "arrive [1, 3, 1] max_tokens=2 (a session)", "arrive [1, 3, 1] max_tokens=2 (a session)",
        "schedule", "model answers: stop, stop", "arrive [1, 3, 1] max_tokens=2",
        "clock +3 s", "schedule"]
    monkeypatch.undo()
    sched, outs = replay(str(tmp_path / "violation.jsonl"))
    assert outs[-1].preempted_req_ids == {"r1"} and "r3" in sched.slot_ledger.holders


def test_cap_on_idle_sessions_explored(monkeypatch: pytest.MonkeyPatch) -> None:
    # With max_idle_sessions=1 every interleaving keeps at most one idle session holding a
    # slot or KV after each step; without the cap's reclaim the checker says so.
    cfg = ExploreConfig(**{**_fields(MUTATION_CFG), "max_idle_sessions": 1, "depth": 6,
                           "menu": Menu(**{**_fields(MUTATION_CFG.menu), "ticks": True})})
    report = explore(cfg)
    assert report.violation is None, report.summary()
    assert report.effects["idle session's slot taken"] > 0
    monkeypatch.setattr(StreamingSessions, "over_cap", lambda self, holds: [])
    report = explore(cfg)
    assert report.violation is not None and "[idle cap]" in report.violation.error


# --------------------------------------------------------------------------- pieces
def test_a_session_timeout_replays_from_its_trace(tmp_path: Path) -> None:
    events = [Arrive((1, 3, 1), 2, resumable=True), Schedule(), Update(((STOP,),)),
              Tick(11.0), Schedule()]
    cfg = ExploreConfig(session_timeout_s=10.0)
    trace = tmp_path / "timeout.jsonl"
    h = Harness(cfg.scheduler())
    for e in events[:3]:
        h.apply(e)
    assert list(h.sched.sessions.idle) == ["r1"]
    for e in events[3:]:
        h.apply(e)
    assert not h.sched.requests
    write_trace(cfg, events, str(trace))
    sched, outs = replay(str(trace))
    assert not sched.requests and "r1" in outs[-1].finished_req_ids
    # Without the clock the schedule() calls were given, the session would still be idle.
    records = [json.loads(ln) for ln in trace.read_text().splitlines()]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "now"}) + "\n"
                             for r in records))
    sched, _ = replay(str(plain))
    assert list(sched.sessions.idle) == ["r1"]


def test_states_equal_up_to_renaming_share_a_key() -> None:
    cfg = ExploreConfig()
    a, b = Harness(cfg.scheduler()), Harness(cfg.scheduler())
    for e in (Arrive((1, 3), 2), Abort(0), Arrive((1, 3, 1), 2), Schedule(),
              Update(((TOKEN,),))):
        a.apply(e)
    for e in (Arrive((1, 3, 1), 2), Schedule(), Update(((TOKEN,),))):
        b.apply(e)
    assert set(a.sched.requests) == {"r2"} and set(b.sched.requests) == {"r1"}
    assert canonical_key(a) == canonical_key(b)
    b.apply(Schedule())
    assert canonical_key(a) != canonical_key(b)


# --------------------------------------------------------------------------- adapter slots
LORA_MENU = Menu(prompts=((1, 3, 1),), max_tokens=(2,), sessions=True, loras=(1, 2),
                 resets=True, ticks=True)
LORA_CFG = ExploreConfig(max_num_seqs=2, num_blocks=6, block_size=2, max_num_batched_tokens=6,
                         max_loras=1, depth=6, menu=LORA_MENU)


def test_adapter_slots_explored() -> None:
    # Two request slots, one adapter slot, two adapters (the base is covered by the CI
    # exploration and the fuzzer), sessions past their grace period, resets, aborts: every
    # interleaving of 6 events keeps the adapter rules, and every state drains.
    report = explore(LORA_CFG)
    assert report.violation is None, report.summary()
    assert report.drained == report.distinct - 1 and report.distinct > 10_000
    assert report.effects["idle session's slot taken"] > 0


def _forget_paused_adapter_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's bug for adapters: admission counts adapter users only among running
    requests, so a paused session's adapter looks unused and its slot is given away."""
    original = Scheduler._schedule_waiting

    def schedule_waiting(self: Scheduler, *args):  # noqa: ANN002, ANN202
        ledger = self.lora_slots
        saved = {a: set(u) for a, u in ledger.users.items()}
        for users in ledger.users.values():
            users.intersection_update(r.request_id for r in self.running)
        try:
            return original(self, *args)
        finally:
            for a, u in saved.items():
                ledger.users.setdefault(a, set()).update(u)

    monkeypatch.setattr(Scheduler, "_schedule_waiting", schedule_waiting)


def test_adapter_over_admission_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _forget_paused_adapter_users(monkeypatch)
    trace = tmp_path / "violation.jsonl"
    # Shortest: a session under adapter 1 pauses holding its slots, a request for adapter 2
    # arrives, and admission reloads the paused session's adapter slot.
    assert _find_violation(LORA_CFG, trace, capsys) == [
        "arrive [1, 3, 1] max_tokens=2 lora=1 (a session)", "schedule", "model answers: stop",
        "arrive [1, 3, 1] max_tokens=2 lora=2", "schedule"]
    with pytest.raises(InvariantViolation, match="adapter slot"):
        replay(str(trace))
    monkeypatch.undo()
    sched, outs = replay(str(trace))
    assert not outs[-1].lora_loads and sched.requests["r2"].status.name == "WAITING"
