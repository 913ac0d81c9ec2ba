"""The engine core records the clock it hands the scheduler, so its trace replays an idle
session's timeout at the step where it happened (SLOTSERVE_TRACE / trace_path)."""

from __future__ import annotations

from pathlib import Path

from slotserve.check.trace import replay
from slotserve.sampling_params import SamplingParams
from tests.helpers import FakeEngineFactory, bounded


def test_engine_trace_replays_an_idle_timeout(fake_engine: FakeEngineFactory,
                                              tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    engine = fake_engine(streaming_session_timeout_s=0.0, trace_path=str(path))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, params, resumable=True)
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    (out,) = engine.step()  # the idle session times out on the next step
    assert out.finished and "idle" in (out.outputs[0].finish_message or "")
    engine.step()  # delivers its slot release
    replayed, outs = replay(str(path))
    assert not replayed.requests
    assert [o for o in outs if "s" in o.finished_req_ids]
