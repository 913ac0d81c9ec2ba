"""A real uvicorn server on a free localhost port, shared by the server tests.

One AsyncLLM on the bundled model serves every test (building an engine takes seconds); a
second app on the same engine adds an API key. Both servers run on one event loop in a
background thread, the loop the AsyncLLM is bound to.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.limits import ServerLimits, uvicorn_config

API_KEY = "test-key-123"
MODEL_NAME = "slotserve-test"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 24
ENGINE_ARGS: dict[str, Any] = dict(
    model=None, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16,
    num_blocks=640, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024, check=True,
    seed=0)


class LoopThread:
    """An asyncio loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class RunningServer:
    base_url: str
    server: uvicorn.Server
    done: Future[Any]

    def stop(self) -> None:
        self.server.should_exit = True
        self.done.result(20)


def start_server(loop: LoopThread, app: Any, limits: ServerLimits | None = None
                 ) -> RunningServer:
    """The app behind uvicorn configured as `slotserve serve` configures it (the limits'
    uvicorn options and connection deadlines)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sansio = importlib.util.find_spec("uvicorn.protocols.websockets.websockets_sansio_impl")
    server = uvicorn.Server(uvicorn_config(
        app, limits or app.state.limits, log_level="warning", lifespan="off",
        ws="websockets-sansio" if sansio else "websockets"))
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + 20
    while not server.started:
        if done.done():
            done.result()
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start")
        time.sleep(0.01)
    return RunningServer(f"http://127.0.0.1:{port}", server, done)


@dataclass
class Served:
    loop: LoopThread
    engine: AsyncLLM
    url: str
    key_url: str

    def call_utility(self, method: str, *args: Any) -> Any:
        """An EngineCore method by name (tests/core_utilities.py adds the tests' own)."""
        return self.loop.run(self.engine.call_utility(method, *args))

    def engine_state(self) -> dict[str, Any]:
        state = self.call_utility("core_state")
        state.update(self.loop.run(front_state(self.engine)))
        return state

    def wait_drained(self, timeout: float = 20.0) -> dict[str, Any]:
        """Poll until no request, block or slot is held; returns the last state seen."""
        deadline = time.monotonic() + timeout
        state = self.engine_state()
        while not is_drained(state) and time.monotonic() < deadline:
            time.sleep(0.05)
            state = self.engine_state()
        return state


async def front_state(engine: AsyncLLM) -> dict[str, Any]:
    """What the front holds (read on its event loop)."""
    front = engine.engine
    return {"groups": sorted(front.output_processor.groups),
            "front_busy": front.has_unfinished_requests()}


def is_drained(state: dict[str, Any]) -> bool:
    unfinished = state["core_busy"] or state["front_busy"]
    return (not state["requests"] and state["used_blocks"] == 0 and not state["worker_slots"]
            and not state["ledger"] and not state["groups"] and not unfinished)


def scrape(url: str) -> dict[str, float]:
    """Metric samples by name, summed over labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    loop = LoopThread()
    yield loop
    loop.close()


def _serve(loop: LoopThread, mode: str) -> Iterator[Served]:
    engine = AsyncLLM.from_engine_args(**ENGINE_ARGS, engine_mode=mode, threads=1)
    app = build_app(engine, served_model_names=[MODEL_NAME], shutdown_engine=False)
    key_app = build_app(engine, served_model_names=[MODEL_NAME], api_key=API_KEY,
                        enable_admin=True, shutdown_engine=False)
    main = start_server(loop, app)
    keyed = start_server(loop, key_app)
    try:
        yield Served(loop, engine, main.base_url, keyed.base_url)
    finally:
        main.stop()
        keyed.stop()
        engine.shutdown()


@pytest.fixture(scope="session")
def served(loop_thread: LoopThread) -> Iterator[Served]:
    """The engine loop on a thread."""
    yield from _serve(loop_thread, "thread")


@pytest.fixture(scope="session")
def served_process(loop_thread: LoopThread) -> Iterator[Served]:
    """The engine loop in a child process (the server default)."""
    yield from _serve(loop_thread, "process")


def _check_drained(served: Served) -> None:
    state = served.wait_drained()
    assert is_drained(state), f"engine not drained after the test: {state}"


@pytest.fixture()
def drained(served: Served) -> Iterator[Served]:
    """The thread-mode server, checked to hold nothing after the test."""
    yield served
    _check_drained(served)


@pytest.fixture(params=["thread", "process"])
def any_mode(request: pytest.FixtureRequest) -> Iterator[Served]:
    """Each engine mode in turn, checked to hold nothing after the test."""
    served = request.getfixturevalue("served" if request.param == "thread"
                                     else "served_process")
    yield served
    _check_drained(served)
