"""The exhaustive explorer with speculative decoding: a step proposes drafts (ngram over the
request's tokens) and the model accepts 0..k of them, interleaved with preemption, prefix
hits, sessions, resets and failed steps; no invariant breaks and every state drains. Two bugs
put back are found with their shortest sequence: a block hashed while it holds drafts, and a
rejection that does not roll the computed count back."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.check.events import Menu
from slotserve.check.explore import ExploreConfig, explore
from slotserve.check.trace import replay
from slotserve.core.kv_cache_manager import KVCacheManager
from slotserve.core.request import Request
from slotserve.errors import InvariantViolation
from slotserve.spec_decode.scheduling import SpecDecodeScheduler

MENU = Menu(prompts=((1, 3, 1, 3),), chunks=((3,),), max_tokens=(3,), sessions=True,
            ticks=True, failures=True)
SPEC = ExploreConfig(max_num_seqs=2, num_blocks=5, block_size=2, max_num_batched_tokens=6,
                     depth=6, menu=MENU, num_speculative_tokens=2)
EFFECTS = ("drafts proposed", "a draft rejected", "all drafts accepted", "preemption",
           "prefix hit", "reset with running requests", "failed step", "session went idle",
           "token after preemption", "preemption in a step with drafts")


def test_exploration_with_drafts_is_clean() -> None:
    report = explore(SPEC)
    assert report.violation is None, report.summary()
    missing = [e for e in EFFECTS if not report.effects[e]]
    assert not missing, f"not reached: {missing}\n{report.summary()}"
    assert report.drained == report.distinct - 1


def _hash_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafts join the request's tokens while its KV slots are allocated (and so while
    its full blocks are hashed), as if they were accepted."""
    pending: dict[str, list[int]] = {}
    propose, allocate = SpecDecodeScheduler.propose, KVCacheManager.allocate_slots

    def proposing(self: SpecDecodeScheduler, r: Request, *args: int) -> list[int]:
        pending[r.request_id] = drafts = propose(self, r, *args)
        return drafts

    def allocating(self: KVCacheManager, request: Request, n: int, *args, **kw):  # noqa: ANN002, ANN003, ANN202
        d = pending.pop(request.request_id, [])
        tokens = request.all_token_ids
        tokens.extend(d)
        try:
            return allocate(self, request, n, *args, **kw)
        finally:
            del tokens[len(tokens) - len(d):]

    monkeypatch.setattr(SpecDecodeScheduler, "propose", proposing)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocating)


@pytest.mark.parametrize(("mutate", "rule", "expected"), [
    (_hash_drafts, "draft hashed",
     ["arrive [1, 3, 1, 3] max_tokens=3", "schedule", "model answers: [1]", "schedule"]),
    (lambda mp: mp.setattr(SpecDecodeScheduler, "roll_back", lambda self, r: None),
     "draft rollback",
     ["arrive [1, 3, 1, 3] max_tokens=3", "schedule", "model answers: [1]", "schedule",
      "model answers: [1]"]),
], ids=["block-hashed-over-drafts", "rejection-without-rollback"])
def test_spec_mutations_are_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  mutate, rule: str, expected: list[str]) -> None:  # noqa: ANN001
    mutate(monkeypatch)
    trace = tmp_path / "violation.jsonl"
    report = explore(SPEC, str(trace))
    v = report.violation
    assert v is not None and v.kind == "violation" and v.shortest, report.summary()
    assert f"[{rule}]" in v.error
    # After [1, 3, 1, 3] and the sampled 1, the ngram proposer drafts [3, 1].
    assert [str(e) for e in v.events] == expected
    with pytest.raises(InvariantViolation, match=rule):
        replay(str(trace))
    monkeypatch.undo()
    replay(str(trace))  # the real scheduler replays it cleanly
