"""GET /v1/engine/state (issue 20): under a concurrent load of requests and idle streaming
sessions, every poll's slot table is the engine's own (the worker's table and the scheduler's
SlotLedger recorded after the very step the poll followed), and no poll carries prompt text.
Also: it is behind the API key while the page's files are not, --no-webui drops the page
only (also in test_serve_process.py, on a real `serve` process), and the state crosses the
process boundary in the server's default engine mode."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from slotserve.core.request import RequestStatus
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import API_KEY, MAX_NUM_SEQS, LoopThread, Served, start_server

MARKER = "QZXV-MARKER"
SLOTS = 4
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class AfterStep:
    """What the engine held right after one step, recorded in the core's thread."""

    worker: dict[int, str]
    ledger: set[str]
    releasing: set[str]
    statuses: dict[str, RequestStatus]
    used_blocks: int


@dataclass
class Recorded:
    url: str
    core: Any
    history: dict[int, AfterStep]


@pytest.fixture(scope="module")
def recorded(loop_thread: LoopThread) -> Iterator[Recorded]:
    """A keyed server on a small engine (4 slots, a KV cache the load fills) whose core
    records its slot table after every step."""
    engine = AsyncLLM.from_engine_args(
        max_num_seqs=SLOTS, num_blocks=40, block_size=16, max_model_len=256, device="cpu",
        dtype="float32", check=True, seed=0, engine_mode="thread", threads=1)
    server = start_server(loop_thread, build_app(
        engine, served_model_names=["m"], api_key=API_KEY, shutdown_engine=False))
    history: dict[int, AfterStep] = {}

    def record(core: Any) -> Any:
        sched = core.scheduler
        pool = sched.kv_cache_manager.block_pool
        history[core.num_steps] = AfterStep(
            dict(core.model_runner.slots.index_to_req_id), set(sched.slot_ledger.holders),
            set(sched.slot_ledger.releasing),
            {rid: r.status for rid, r in sched.requests.items()},
            pool.num_usable_blocks - pool.get_num_free_blocks())
        return core

    core = loop_thread.run(engine.call_utility("engine_core"))
    record(core)  # before the first step
    step = core.step

    def recording_step() -> Any:
        out = step()
        record(core)
        return out

    core.step = recording_step
    try:
        yield Recorded(server.base_url, core, history)
    finally:
        server.stop()
        engine.shutdown()


def _complete(url: str, i: int, errors: list[str]) -> None:
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "m", "prompt": f"{MARKER} {i} To be, or not", "max_tokens": 24 + 4 * i,
        "ignore_eos": True, "user": f"client-{i % 3}"})
    if r.status_code != 200:
        errors.append(r.text)


def _session(url: str, errors: list[str]) -> None:
    """A streaming session: a chunk, idle a while (holding its slot), a chunk, the end."""
    try:
        with connect(url.replace("http", "ws") + "/v1/sessions", open_timeout=30,
                     additional_headers=AUTH) as ws:
            json.loads(ws.recv(timeout=30))
            for prompt in (f"{MARKER} Now is the winter", f"{MARKER} of our discontent"):
                ws.send(json.dumps({"type": "input", "prompt": prompt, "max_tokens": 6,
                                    "ignore_eos": True}))
                while json.loads(ws.recv(timeout=60))["type"] != "chunk.done":
                    pass
                time.sleep(0.6)
            ws.send(json.dumps({"type": "end"}))
            json.loads(ws.recv(timeout=30))
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(repr(exc))


def _check_poll(state: dict[str, Any], after: AfterStep) -> None:
    slots = state["slots"]
    assert [s["index"] for s in slots] == list(range(SLOTS))
    held = {s["index"]: s["request_id"] for s in slots if s["status"] != "free"}
    assert all(s["request_id"] is None for s in slots if s["status"] == "free")
    # Held in the view exactly where the worker holds a slot, by the ledger's holders.
    assert held == after.worker
    assert set(held.values()) == after.ledger
    moved = False  # an idle session moved between the step and the poll
    for s in slots:
        rid = s["request_id"]
        if rid is None:
            continue
        status = after.statuses.get(rid)
        expected = {RequestStatus.RUNNING: "running",
                    RequestStatus.WAITING_FOR_STREAMING_REQ: "idle"}.get(status, "waiting")
        if rid in after.releasing or status is None:
            expected = "released"
        # Between two steps an idle session's next chunk moves it to the queue, and its end
        # mark ends it (the worker frees its slot with the next step).
        assert s["status"] == expected or (expected == "idle"
                                           and s["status"] in ("waiting", "released")), s
        moved = moved or s["status"] != expected
    # Blocks are taken only in a step; between two steps an ended session frees its own.
    if moved:
        assert state["num_blocks_used"] <= after.used_blocks
    else:
        assert state["num_blocks_used"] == after.used_blocks
    assert (state["num_blocks_used"] + state["num_blocks_cached"] + state["num_blocks_free"]
            == state["num_blocks"])


def test_state_agrees_with_the_ledger_at_every_poll(recorded: Recorded) -> None:
    url, errors = recorded.url, []
    threads = [threading.Thread(target=_complete, args=(url, i, errors)) for i in range(10)]
    threads += [threading.Thread(target=_session, args=(url, errors)) for _ in range(2)]
    # A session that pauses while nothing waits keeps its slot for the whole pause, so some
    # poll sees it idle (one that pauses while completions wait gives its slot to one of them
    # within a step, and the polls caught that only now and then).
    busy = list(threads)
    threads.append(threading.Thread(
        target=lambda: ([t.join() for t in busy], _session(url, errors))))
    for t in threads:
        t.start()
    polls: list[tuple[str, dict[str, Any]]] = []
    with httpx.Client(headers=AUTH, timeout=30) as http:
        while any(t.is_alive() for t in threads):
            r = http.get(f"{url}/v1/engine/state")
            assert r.status_code == 200, r.text
            polls.append((r.text, r.json()))
        for t in threads:
            t.join()
        assert not errors, errors
        deadline = time.monotonic() + 10
        while True:  # the last releases reach the worker with one more step
            r = http.get(f"{url}/v1/engine/state")
            final = r.json()
            if all(s["status"] == "free" for s in final["slots"]) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert all(s["status"] == "free" for s in final["slots"]), final
    assert final["num_blocks_used"] == 0 and final["admission"]["clients"] == []
    assert len(polls) > 20
    for text, state in polls:
        assert MARKER not in text
        assert state["max_num_seqs"] == SLOTS
        _check_poll(state, recorded.history[state["num_steps"]])
    states = [s for _, s in polls]
    # The load reached every state the view shows.
    assert any(all(s["status"] != "free" for s in st["slots"]) for st in states)
    assert any(s["status"] == "idle" for st in states for s in st["slots"])
    assert any(s["status"] == "running" and s["num_tokens"] for st in states
               for s in st["slots"])
    assert any(st["num_waiting"] + st["admission"]["queued"] for st in states)
    assert any(len(st["admission"]["clients"]) >= 2 for st in states)
    assert final["generation_tokens_total"] >= sum(24 + 4 * i for i in range(10))


def test_state_needs_the_key_and_the_page_does_not(recorded: Recorded) -> None:
    url = recorded.url
    r = httpx.get(f"{url}/v1/engine/state")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<meta name="slotserve-auth" content="key">' in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'self'
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{url}/webui/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert httpx.get(f"{url}/webui/nothing.js").status_code == 401  # not a page file
    assert httpx.get(f"{url}/v1/models").status_code == 401


def test_no_webui_keeps_the_state(served: Served) -> None:
    app = build_app(served.engine, served_model_names=["m"], webui=False,
                    shutdown_engine=False)
    server = start_server(served.loop, app)
    try:
        assert httpx.get(f"{server.base_url}/").status_code == 404
        assert httpx.get(f"{server.base_url}/webui/app.js").status_code == 404
        assert httpx.get(f"{server.base_url}/v1/engine/state").status_code == 200
    finally:
        server.stop()
    page = httpx.get(f"{served.url}/")
    assert '<meta name="slotserve-auth" content="none">' in page.text


def test_state_from_an_engine_process(served_process: Served) -> None:
    state = httpx.get(f"{served_process.url}/v1/engine/state", timeout=30).json()
    assert state["object"] == "engine.state" and state["max_num_seqs"] == MAX_NUM_SEQS
    assert {s["status"] for s in state["slots"]} == {"free"}
    assert state["num_blocks_used"] == 0 and state["num_waiting_for_grammar"] == 0


# `slotserve serve --no-webui` as a user runs it: test_serve_process.py (one server process
# for it and the SIGTERM check).
