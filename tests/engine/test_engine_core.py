"""The core side of the engine boundary: typed requests in, typed output batches out."""

from __future__ import annotations

import time

from slotserve.config import CacheConfig, EngineConfig, SchedulerConfig
from slotserve.engine.core import EngineCore
from slotserve.engine.core_client import ThreadClient
from slotserve.engine.messages import EngineCoreRequest
from slotserve.sampling_params import SamplingParams
from tests.helpers import FakeModelRunner, bounded

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def make_core(timeout_s: float = 600.0) -> EngineCore:
    config = EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64,
                                          streaming_session_timeout_s=timeout_s),
                          CacheConfig(num_blocks=32, block_size=4), check=True)
    return EngineCore(config, FakeModelRunner(4, 100))


def request(rid: str, prompt: list[int], **kwargs: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, PARAMS, None, time.monotonic(), **kwargs)  # type: ignore[arg-type]


def test_a_chunk_for_a_session_that_ended_in_the_core_is_dropped() -> None:
    core = make_core(timeout_s=0.0)
    core.add_request(request("s", [5, 6, 7], resumable=True))
    for _ in bounded(core.has_requests):
        core.step()
    (out,) = core.step().outputs  # idle, then timed out
    assert out.finished and "idle" in (out.finish_message or "")
    # The front had not heard of the timeout yet when it sent the next chunk and the end mark.
    core.add_request(request("s", [8, 9], resumable=True, continues_session=True))
    core.add_request(request("s", [], continues_session=True))
    core.step()
    assert not core.scheduler.requests and not core.has_requests()


def test_a_request_the_core_refuses_ends_with_an_error_and_the_core_goes_on() -> None:
    client = ThreadClient(make_core())
    try:
        client.add_request(request("a", [5, 6, 7]))
        client.add_request(request("a", [5, 6, 7]))  # the same id: not a session
        outs = {}
        for _ in bounded(lambda: len(outs) < 2):
            for o in client.get_output().outputs:
                if o.finished:
                    outs.setdefault(o.finish_reason, o)
        assert "duplicate request id" in (outs["error"].finish_message or "")
        assert outs["length"].request_id == "a"
        assert client.get_stats().result(10).num_failed_steps == 0
        assert client.dead_error is None
    finally:
        client.shutdown()
