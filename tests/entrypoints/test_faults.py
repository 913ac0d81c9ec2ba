"""A fault inside the model step: its requests fail with a 500 and a message, the server keeps
serving (or, when the engine cannot continue, /health turns 503)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from tests.core_utilities import POISON
from tests.entrypoints.conftest import ENGINE_ARGS, MODEL_NAME, LoopThread, Served, start_server

BODY = {"model": MODEL_NAME, "prompt": "Once more unto the breach", "max_tokens": 12,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture()
def fault(any_mode: Served) -> Iterator[Any]:
    def arm(after: int) -> None:
        any_mode.call_utility("install_fault", after)

    yield arm
    any_mode.call_utility("remove_fault")


def test_fault_fails_request_with_500_and_engine_goes_on(
        any_mode: Served, fault: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    fault(0)
    r = httpx.post(f"{any_mode.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "internal_server_error" and error["code"] == "model_step_failed"
    # The client gets the request id, the log gets what went wrong (no internal text or
    # module path in a response).
    assert "injected" not in r.text and "RuntimeError" not in r.text and ".py" not in r.text
    request_id = error["message"].split()[1]
    assert request_id.startswith("cmpl-")
    assert any(request_id in rec.getMessage() and "injected fault" in rec.getMessage()
               for rec in caplog.records)
    # The engine could continue: healthy, and the next request succeeds.
    assert httpx.get(f"{any_mode.url}/health").status_code == 200
    ok = httpx.post(f"{any_mode.url}/v1/completions", json=BODY, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12


def test_fault_mid_stream_reports_error_event(any_mode: Served, fault: Any) -> None:
    fault(4)
    events = []
    with httpx.stream("POST", f"{any_mode.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Speak"}],
            "max_tokens": 30, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "model_step_failed" and "injected" not in error["message"]
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert sum(1 for c in contents if c) >= 1
    assert httpx.get(f"{any_mode.url}/health").status_code == 200


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_engine_that_cannot_continue_turns_health_503(loop_thread: LoopThread,
                                                      mode: str) -> None:
    engine = AsyncLLM.from_engine_args(**{**ENGINE_ARGS, "num_blocks": 64, "check": False},
                                       engine_mode=mode, threads=1)
    server = start_server(loop_thread, build_app(engine, served_model_names=[MODEL_NAME],
                                                 shutdown_engine=False))
    try:
        url = server.base_url
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200

        loop_thread.run(engine.call_utility("break_scheduler"))
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert "injected" not in r.text and "corrupted" not in r.text
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        later = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/metrics").status_code == 200
    finally:
        server.stop()
        engine.shutdown()


def test_killed_engine_process_turns_health_503(loop_thread: LoopThread) -> None:
    engine = AsyncLLM.from_engine_args(**{**ENGINE_ARGS, "num_blocks": 64, "check": False},
                                       engine_mode="process", threads=1)
    server = start_server(loop_thread, build_app(engine, served_model_names=[MODEL_NAME],
                                                 shutdown_engine=False))
    try:
        url = server.base_url
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                **BODY, "max_tokens": 400, "stream": True}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(engine.engine.engine_core.pid, signal.SIGKILL)  # dies mid-stream
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 503
    finally:
        server.stop()
        engine.shutdown()


# --------------------------------------------------------------------------- isolation
def test_a_request_fault_fails_only_that_request(any_mode: Served) -> None:
    """Co-batched with the faulty request, every other request completes normally."""
    any_mode.call_utility("install_request_fault")
    try:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=any_mode.url, timeout=60) as http:
                bodies = [{**BODY, "prompt": [1, 300 + i, 301 + i, 302], "user": f"u{i}"}
                          for i in range(5)]
                bodies[2]["prompt"] = [1, POISON, 300, 301]
                return list(await asyncio.gather(*(http.post("/v1/completions", json=b)
                                                   for b in bodies)))

        responses = asyncio.run(run())
    finally:
        any_mode.call_utility("remove_request_fault")
    assert [r.status_code for r in responses] == [200, 200, 500, 200, 200]
    assert responses[2].json()["error"]["code"] == "model_step_failed"
    for r in responses[:2] + responses[3:]:
        assert r.json()["usage"]["completion_tokens"] == 12
    assert httpx.get(f"{any_mode.url}/health").status_code == 200
