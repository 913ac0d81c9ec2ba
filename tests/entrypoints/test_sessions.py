"""Streaming-input sessions over the /v1/sessions WebSocket."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, Served, scrape


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://") + "/v1/sessions"


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=60))


def run_chunk(ws: ClientConnection, index: int, **chunk: Any) -> list[int]:
    """Send one chunk and collect its token ids up to its chunk.done message."""
    ws.send(json.dumps({"type": "input", "temperature": 0, "ignore_eos": True, **chunk}))
    tokens: list[int] = []
    while True:
        msg = recv(ws)
        assert msg["type"] in ("delta", "chunk.done"), msg
        assert msg["chunk"] == index
        if msg["type"] == "chunk.done":
            assert msg["usage"]["completion_tokens"] == len(tokens)
            return tokens
        tokens.extend(msg["token_ids"])


def tokenize(url: str, text: str, special: bool) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": text,
                                               "add_special_tokens": special}).json()["tokens"]


def test_chunked_conversation_equals_one_shot(any_mode: Served) -> None:
    pieces = [("To be, or not to be,", 3), (" that is the question:", 2),
              (" whether 'tis nobler in the mind", 12)]
    with connect(ws_url(any_mode.url), open_timeout=30) as ws:
        created = recv(ws)
        assert created["type"] == "session.created" and created["model"] == MODEL_NAME
        outputs = [run_chunk(ws, i, prompt=text, max_tokens=m)
                   for i, (text, m) in enumerate(pieces)]
        ws.send(json.dumps({"type": "end"}))
        done = recv(ws)
        assert done["type"] == "session.done"
        assert done["usage"]["completion_tokens"] == sum(len(o) for o in outputs) == 17
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert [len(o) for o in outputs] == [3, 2, 12]
    # The engine's view of the session: every chunk, plus each earlier chunk's outputs
    # without its last sampled token (never fed back). Greedy decoding of that one prompt
    # must give the last chunk's output.
    prompt = tokenize(any_mode.url, pieces[0][0], True)
    for (text, _), out in zip(pieces[1:], outputs[:-1], strict=True):
        prompt += out[:-1] + tokenize(any_mode.url, text, False)
    r = httpx.post(f"{any_mode.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    one_shot_text = r.json()["choices"][0]["text"]
    detok = httpx.post(f"{any_mode.url}/detokenize", json={"tokens": outputs[-1]}).json()
    assert one_shot_text == detok["prompt"]


def test_token_id_chunks_and_bad_messages(drained: Served) -> None:
    with connect(ws_url(drained.url), open_timeout=30) as ws:
        recv(ws)
        for bad in ("not json", json.dumps({"type": "input", "prompt": "x", "n": 2}),
                    json.dumps({"type": "input", "prompt": "x", "temperature": -1}),
                    json.dumps({"type": "input", "prompt": "x", "stop": ["a"]}),
                    json.dumps({"type": "dance"}),
                    json.dumps({"type": "input", "prompt": "x", "model": "other"}),
                    json.dumps({"type": "input", "prompt": [5] * 5000})):
            ws.send(bad)
            msg = recv(ws)
            assert msg["type"] == "error" and msg["fatal"] is False, msg
            assert set(msg["error"]) == {"message", "type", "param", "code"}
        first = run_chunk(ws, 0, prompt=[1, 300, 301, 302], max_tokens=4)
        second = run_chunk(ws, 1, prompt=[303, 304], max_tokens=3)
        assert len(first) == 4 and len(second) == 3
        ws.send(json.dumps({"type": "end"}))
        assert recv(ws)["type"] == "session.done"


def test_paused_session_then_dropped_connection_frees_everything(any_mode: Served) -> None:
    with connect(ws_url(any_mode.url), open_timeout=30) as ws:
        recv(ws)
        run_chunk(ws, 0, prompt="Now is the winter of our discontent", max_tokens=2)
        # Between chunks the session is paused, holding its KV blocks and its slot.
        deadline = time.monotonic() + 10
        while scrape(any_mode.url)["slotserve:num_paused_sessions"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        state = any_mode.engine_state()
        assert state["used_blocks"] > 0 and len(state["worker_slots"]) == 1
    state = any_mode.wait_drained()
    assert state["used_blocks"] == 0 and not state["worker_slots"], state


def test_dropped_connection_mid_chunk_frees_everything(any_mode: Served) -> None:
    with connect(ws_url(any_mode.url), open_timeout=30) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "input", "prompt": "Friends, Romans, countrymen,",
                            "max_tokens": 400, "ignore_eos": True}))
        assert recv(ws)["type"] == "delta"
    state = any_mode.wait_drained()
    assert state["used_blocks"] == 0 and not state["worker_slots"], state


def test_session_needs_api_key(served: Served) -> None:
    with pytest.raises(InvalidStatus):
        connect(ws_url(served.key_url), open_timeout=30)
    with connect(ws_url(served.key_url), open_timeout=30,
                 additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        assert recv(ws)["type"] == "session.created"
        ws.send(json.dumps({"type": "end"}))
        assert recv(ws)["type"] == "session.done"


def test_a_chunk_the_session_cannot_hold_is_refused_as_that_chunk(drained: Served) -> None:
    from tests.entrypoints.conftest import MAX_MODEL_LEN

    half = MAX_MODEL_LEN // 2
    with connect(ws_url(drained.url), open_timeout=30) as ws:
        recv(ws)
        run_chunk(ws, 0, prompt=[1] + [300] * half, max_tokens=4)
        # Fits alone, not after what the session holds: the engine refuses it as chunk 1.
        ws.send(json.dumps({"type": "input", "prompt": [301] * half, "max_tokens": 2}))
        msg = recv(ws)
        assert msg["type"] == "error" and msg["fatal"] is False and msg["chunk"] == 1, msg
        assert "max_model_len" in msg["error"]["message"]
        assert len(run_chunk(ws, 2, prompt=[302, 303], max_tokens=3)) == 3
        ws.send(json.dumps({"type": "end"}))
        done = recv(ws)
        assert done["type"] == "session.done" and done["reason"] == "end"
        assert done["usage"]["completion_tokens"] == 7
