"""`slotserve serve --data-parallel-size 2` as users run it: a local Ray cluster whose
ingress serves `--port` itself (Serve's direct ingress, no proxy on the path), a streamed
completion through the official `openai` client (coalesced with `--stream-interval`), each
answer naming its replica, and SIGINT stopping everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

pytest.importorskip("ray.serve")

from tests.ray.test_ray_serve import REPLICA_HEADER, _free_port, _ray_processes  # noqa: E402

# 600: the time counts its wait for test_ray_serve.py's cluster (conftest.ray_turn).
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def test_serve_data_parallel_streams_through_the_ingress_and_stops_clean(ray_turn: None
                                                                          ) -> None:
    if _ray_processes():
        pytest.skip("a Ray cluster is already running on this machine")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--data-parallel-size",
         "2", "--threads", "1", "--port", str(port), "--host", "127.0.0.1", "--max-model-len",
         "512", "--num-blocks", "128", "--stream-interval", "4", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no replica answered in time"
            try:
                if httpx.post(f"{url}/v1/completions", timeout=30, json={
                        "prompt": "x", "max_tokens": 1}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        chunks = list(client.completions.create(model="slotserve-default", prompt="To be",
                                                max_tokens=11, stream=True, temperature=0))
        whole = client.completions.create(model="slotserve-default", prompt="To be",
                                          max_tokens=11, temperature=0)
        # Batched events are the same events: 11 tokens, the same text as unstreamed.
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert httpx.get(f"{url}/health", timeout=30).headers[REPLICA_HEADER]
        # Each replica's engine core runs on a core of its own (the local cluster pins them).
        pinned = sorted(tuple(sorted(os.sched_getaffinity(core.pid)))
                        for core in _engine_cores(proc.pid))
        assert len(pinned) == 2 and all(len(c) == 1 for c in pinned), pinned
        assert pinned[0] != pinned[1], pinned
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == []


def _engine_cores(server_pid: int) -> list[psutil.Process]:
    """The engine core processes under the replicas' actors (children of a LLMServer)."""
    cores = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "LLMServer" in " ".join(p.info["cmdline"] or []):
                cores += [c for c in p.children() if "child_main" in " ".join(c.cmdline())]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return cores
