"""A session's chunks are numbered by the front, and their ends are events the core sends:
the front keeps no copy of the session's state machine."""

from __future__ import annotations

from slotserve.core.outputs import FinishReason
from slotserve.engine.llm_engine import LLMEngine
from slotserve.outputs import RequestOutput
from slotserve.sampling_params import SamplingParams
from tests.helpers import FakeEngineFactory, bounded

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in bounded(engine.has_unfinished_requests):
        outs += [o for o in engine.step() if o.request_id == "s"]
    return outs


def test_outputs_name_their_chunk_and_its_end(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, PARAMS, resumable=True)
    engine.add_request("s", {"prompt_token_ids": [8]}, PARAMS, resumable=True)  # queued
    outs = drain(engine)
    assert [o.chunk for o in outs if o.chunk_done] == [0, 1]
    assert all(not o.finished for o in outs)
    # Every output before a chunk's end belongs to that chunk, in order.
    assert [o.chunk for o in outs] == sorted(o.chunk for o in outs)
    engine.add_request("s", {"prompt_token_ids": []}, None)  # the end mark, while idle
    (end,) = drain(engine)
    assert end.finished and not end.chunk_done and end.session_end == FinishReason.END
    assert not engine.output_processor.groups and not engine.has_unfinished_requests()


def test_a_chunk_the_session_cannot_hold_is_refused_and_the_session_goes_on(
        fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(max_model_len=32)
    engine.add_request("s", {"prompt_token_ids": list(range(10, 30))}, PARAMS, resumable=True)
    (done,) = [o for o in drain(engine) if o.chunk_done]
    assert done.chunk == 0 and not done.outputs[0].rejected
    # 20 + 3 kept outputs + 10 > 31: only the core knows the exact length, and decides.
    engine.add_request("s", {"prompt_token_ids": list(range(40, 50))}, PARAMS, resumable=True)
    (refused,) = drain(engine)
    assert refused.chunk == 1 and refused.chunk_done and not refused.finished
    c = refused.outputs[0]
    assert c.rejected and c.finish_reason == "length" and not c.token_ids
    assert "max_model_len" in (c.finish_message or "")
    # The session is as it was: a chunk that fits runs, numbered after the refused one.
    engine.add_request("s", {"prompt_token_ids": [60]}, SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True), resumable=True)
    outs = drain(engine)
    assert outs[-1].chunk == 2 and outs[-1].chunk_done and not outs[-1].outputs[0].rejected
    assert len(outs[-1].outputs[0].token_ids) == 2  # cumulative outputs
    engine.add_request("s", {"prompt_token_ids": []}, None)
    assert drain(engine)[-1].session_end == FinishReason.END
    state = engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    assert not state.requests


def test_an_idle_timeout_is_the_session_end_it_is(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(streaming_session_timeout_s=0.0)
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, PARAMS, resumable=True)
    outs = drain(engine)
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == "s"]
    assert outs[-1].session_end == FinishReason.IDLE_TIMEOUT and outs[-1].chunk == 0
    assert outs[-1].outputs[0].finish_reason == "abort"
