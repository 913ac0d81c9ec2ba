"""A client's grammar masks may take at most `mask_budget_s` of a step together: past it, its
costliest requests are refused with a clear error (after a second time over, so a one-off
spike is not), other clients' requests and offline requests (no client) go on. Real
llguidance on the fake model's engine; the ITL effect is benchmarks/grammar_isolation.py's."""

from __future__ import annotations

from slotserve.engine.llm_engine import LLMEngine
from slotserve.outputs import RequestOutput
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_engine_fake import assert_idle
from tests.helpers import FakeEngineFactory

AMBIGUOUS = StructuredOutputsParams(grammar='start: s\ns: s s | "a" | "b"')


def run(engine: LLMEngine, requests: dict[str, tuple[SamplingParams, str | None]]
        ) -> dict[str, list[RequestOutput]]:
    """Add each request for its client (None: offline), step until all are done."""
    for rid, (params, client) in requests.items():
        processed = engine.process_request(rid, "To be", params)
        for r in processed.requests:
            r.client = client
        engine.add_processed_request(processed)
    done: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done.setdefault(out.request_id, []).append(out)
    return done


def test_client_over_its_mask_budget_is_refused(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    manager = engine.engine_core.engine_core.structured_output_manager  # type: ignore[attr-defined]
    manager.mask_budget_s = 1e-9  # every client's rows are over it
    constrained = SamplingParams(max_tokens=12, ignore_eos=True, structured_outputs=AMBIGUOUS)
    done = run(engine, {"hostile": (constrained.clone(n=4), "user:hostile"),
                        "offline": (constrained, None),
                        "plain": (SamplingParams(max_tokens=12, ignore_eos=True), "user:other")})
    hostile = [c for out in done["hostile"] for c in out.outputs]
    assert len(hostile) == 4
    for c in hostile:
        assert c.finish_reason == "error", c
        assert "too costly" in (c.finish_message or "") and "budget" in (c.finish_message or "")
        assert len(c.token_ids) == 2  # refused the second time over, after that step
    assert manager.stats.num_mask_refused == 4
    (offline,) = done["offline"][-1].outputs
    assert offline.finish_reason in ("stop", "length"), offline  # the grammar may end it
    (plain,) = done["plain"][-1].outputs
    assert plain.finish_reason == "length" and len(plain.token_ids) == 12
    assert_idle(engine)


def test_within_the_budget_nothing_is_refused(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    manager = engine.engine_core.engine_core.structured_output_manager  # type: ignore[attr-defined]
    manager.mask_budget_s = 10.0
    constrained = SamplingParams(max_tokens=12, ignore_eos=True, structured_outputs=AMBIGUOUS)
    done = run(engine, {"hostile": (constrained.clone(n=4), "user:hostile")})
    assert all(c.finish_reason != "error" for out in done["hostile"] for c in out.outputs)
    assert manager.stats.num_mask_refused == 0
    assert_idle(engine)
