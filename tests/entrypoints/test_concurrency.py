"""64 concurrent streaming clients, a random third of which hang up mid-stream: afterwards no
KV block, slot or request is held, and /metrics agrees with what the clients saw."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from tests.entrypoints.conftest import MODEL_NAME, Served, scrape

NUM_CLIENTS = 64
MAX_TOKENS = 32


async def one_client(http: httpx.AsyncClient, user: str, prompt: list[int],
                     hang_up_after: int | None) -> dict[str, Any]:
    # Each client names itself (OpenAI's `user`): admission control shares the waiting room
    # per client, and 64 requests from one client would be more than its share.
    body = {"model": MODEL_NAME, "user": user, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True, "temperature": 0.7, "stream_options": {"include_usage": True}}
    chunks = 0
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            if data["choices"]:
                chunks += 1
            if data.get("usage"):
                usage = data["usage"]
            if hang_up_after is not None and chunks >= hang_up_after:
                # Leaving the block closes the connection mid-stream.
                return {"hung_up": True, "chunks": chunks}
    return {"hung_up": False, "chunks": chunks, "usage": usage}


async def run_clients(url: str, prompts: list[list[int]], hang_ups: list[int | None]
                      ) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(
            one_client(http, f"client-{i}", p, h)
            for i, (p, h) in enumerate(zip(prompts, hang_ups, strict=True)))), 180)


def test_64_streaming_clients_with_disconnects(any_mode: Served) -> None:
    rng = random.Random(1234)
    prompts = [[1] + [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 40))]
               for _ in range(NUM_CLIENTS)]
    quitters = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 3))
    # Deltas that pile up while a client lags arrive merged, so a stream can have fewer
    # chunks than a quitter waits for: such a quitter simply completes.
    hang_ups = [rng.randrange(1, 5) if i in quitters else None for i in range(NUM_CLIENTS)]
    before = scrape(any_mode.url)
    results = asyncio.run(run_clients(any_mode.url, prompts, hang_ups))

    completed = [r for r in results if not r["hung_up"]]
    assert all(i in quitters for i, r in enumerate(results) if r["hung_up"])
    assert len(completed) >= NUM_CLIENTS - len(quitters)
    assert len(completed) < NUM_CLIENTS, "no client hung up mid-stream"
    for r in completed:
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    state = any_mode.wait_drained()
    assert state["used_blocks"] == 0 and not state["worker_slots"] and not state["ledger"]
    assert not state["requests"] and not state["groups"], state

    after = scrape(any_mode.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert after["slotserve:num_requests_running"] == 0
    assert after["slotserve:num_requests_waiting"] == 0
    assert after["slotserve:num_paused_sessions"] == 0
    assert after["slotserve:kv_cache_usage_perc"] == 0
    # Every client got at least one token, so every prompt was prefilled exactly once.
    assert delta("slotserve:prompt_tokens_total") == sum(len(p) for p in prompts)
    # Completed clients saw all their tokens; the ones that left saw part of theirs.
    generated = delta("slotserve:generation_tokens_total")
    assert generated >= MAX_TOKENS * len(completed) + sum(r["chunks"] for r in results
                                                          if r["hung_up"])
    assert generated <= MAX_TOKENS * NUM_CLIENTS
    assert delta("slotserve:request_success_total") == len(completed)
    assert delta("slotserve:e2e_request_latency_seconds_count") == len(completed)
    assert delta("slotserve:time_to_first_token_seconds_count") == len(completed)
    assert delta("slotserve:inter_token_latency_seconds_count") == (MAX_TOKENS - 1) * len(
        completed)
