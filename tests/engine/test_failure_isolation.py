"""One request never fails another (issue 11, item 1): a fault tied to one request id fails
that request only; the requests batched with it finish exactly as in a clean run, and the
engine holds nothing afterwards. On the real ModelRunner (the bundled model), checker on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import bounded

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [1, 40, 41, 42], "poison": [1, 50, 51, 52, 53], "b": [1, 60, 61],
           "c": [1, 70, 71, 72, 73, 74]}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(device="cpu", dtype="float32", max_model_len=128,
                                      num_blocks=64, max_num_seqs=8, check=True, seed=0)


def run(engine: LLMEngine, params: dict[str, SamplingParams] | None = None
        ) -> dict[str, tuple[list[int], str | None, str | None]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           (params or {}).get(rid, PARAMS))
    done: dict[str, tuple[list[int], str | None, str | None]] = {}
    for _ in bounded(engine.has_unfinished_requests):
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.finish_reason, c.finish_message)
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    assert not core.scheduler.requests and len(core.model_runner.slots) == 0
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    return done


def poisoned(real: Callable[..., Any]) -> Callable[..., Any]:
    def execute(so: Any, ids: list[str], grammar_output: Any = None) -> Any:
        if "poison" in ids:
            raise RuntimeError("injected fault tied to request 'poison'")
        return real(so, ids, grammar_output)
    return execute


def test_a_fault_tied_to_one_request_fails_only_that_request(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(engine)
    assert all(len(toks) == 8 and reason == "length" for toks, reason, _ in clean.values())
    runner = engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
    monkeypatch.setattr(runner, "_execute", poisoned(runner._execute))
    faulty = run(engine)
    assert faulty["poison"][1] == "error" and "injected fault" in (faulty["poison"][2] or "")
    for rid in ("a", "b", "c"):
        assert faulty[rid] == clean[rid], rid
    stats = engine.get_stats()
    assert stats.num_failed_requests == 1 and stats.num_failed_steps == 0


def test_a_row_that_cannot_be_set_up_fails_only_that_request(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class of the original report: top_k of 2**63 overflowed the worker's int64 buffer
    # while its row was set up, and failed every co-batched request. Validation now refuses
    # such values; one that slips past it anyway fails its own request alone.
    clean = run(engine)
    runner = engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
    real = runner.batch.add_request

    def add_request(slot: int, new: Any) -> None:
        real(slot, new)
        if new.req_id == "poison":
            runner.batch.top_k[slot] = 2**63  # raises OverflowError, as the report did

    monkeypatch.setattr(runner.batch, "add_request", add_request)
    faulty = run(engine)
    assert faulty["poison"][1] == "error" and "OverflowError" in (faulty["poison"][2] or "")
    for rid in ("a", "b", "c"):
        assert faulty[rid] == clean[rid], rid


def test_isolation_reruns_the_batch_one_by_one(monkeypatch: pytest.MonkeyPatch,
                                              engine: LLMEngine) -> None:
    runner: ModelRunner = engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
    calls: list[list[str]] = []
    real = poisoned(runner._execute)

    def spy(so: Any, ids: list[str], grammar_output: Any = None) -> Any:
        calls.append(list(ids))
        return real(so, ids, grammar_output)

    monkeypatch.setattr(runner, "_execute", spy)
    run(engine)
    # The first step batches all four and fails; then each runs alone, and the poisoned one
    # is never scheduled again (it ended with an error).
    assert sorted(calls[0]) == sorted(PROMPTS) and all(len(c) == 1 for c in calls[1:5])
    assert all("poison" not in c for c in calls[5:])
