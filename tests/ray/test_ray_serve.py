"""slotserve on Ray Serve, end to end: a local Ray cluster of 2 CPUs, model `a` on two
replicas and model `b` on one (the bundled model, 1 torch thread each, checkers on), driven
through the official `openai` client. One cluster serves the whole module (it takes most of a
minute to start on a busy 2-core machine); the last test stops it and checks that no Ray
process is left."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import psutil
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from slotserve.ray import build_app  # noqa: E402
from slotserve.ray.server import REPLICA_HEADER  # noqa: E402

pytestmark = pytest.mark.ray
ENGINE = {"max_model_len": 512, "block_size": 16, "num_blocks": 256, "max_num_seqs": 8,
          "check": True, "seed": 0, "device": "cpu", "dtype": "float32"}
RAY_PROCESS_NAMES = ("raylet", "gcs_server")
# A shared prefix of many 16-token blocks (the bundled model's tokenizer is character-level
# enough that this is well over 10 blocks).
SHARED = "ROMEO: But soft, what light through yonder window breaks? It is the east. " * 3


@dataclass
class Cluster:
    base_url: str
    stopped: bool = False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            serve.shutdown()
            ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_processes() -> list[str]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])[:1]])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(n in text for n in RAY_PROCESS_NAMES):
            found.append(f"{p.pid} {text}")
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if _ray_processes():
        pytest.skip("a Ray cluster is already running on this machine")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             logging_level="warning")
    c = Cluster(f"http://127.0.0.1:{port}")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(models=[
            {"name": "a", "engine_kwargs": ENGINE, "num_replicas": 2, "num_cpus": 0.5},
            {"name": "b", "engine_kwargs": ENGINE, "num_replicas": 1, "num_cpus": 0.5}]),
            name="slotserve", route_prefix="/")
        yield c
    finally:
        c.stop()


def complete(c: Cluster, prompt: str, model: str = "a", **kw: Any) -> tuple[str, str]:
    raw = c.client().completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def test_models_completions_chat_and_streams_through_openai(cluster: Cluster) -> None:
    client = cluster.client()
    assert sorted(m.id for m in client.models.list().data) == ["a", "b"]
    replica, text = complete(cluster, "To be, or not")
    assert replica and isinstance(text, str)
    chat = client.chat.completions.with_raw_response.create(
        model="b", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert chat.headers[REPLICA_HEADER] and chat.parse().choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model="a", prompt="Speak", max_tokens=5,
                                            stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_same_prefix_sticks_and_different_prefixes_spread(cluster: Cluster) -> None:
    homes = {complete(cluster, SHARED + f" Request {i}.")[0] for i in range(5)}
    assert len(homes) == 1, f"one shared prefix went to several replicas: {homes}"
    spread = {complete(cluster, f"{i} " * 5 + f"unrelated prompt number {i} " * 6)[0]
              for i in range(8)}
    assert len(spread) == 2, f"cold prompts did not spread: {spread}"


def test_bad_input_gets_the_one_process_4xx(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="a", prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    r = httpx.post(cluster.base_url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(cluster.base_url + "/v1/chat/completions",
                   json={"model": "a", "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_metrics_carry_each_replica(cluster: Cluster) -> None:
    ids = {complete(cluster, f"metrics {i} " * 8)[0] for i in range(6)}

    def labelled() -> bool:
        text = httpx.get(cluster.base_url + "/metrics", timeout=30).text
        return all(f'replica="{r}"' in text for r in ids) and 'model="b"' in text

    eventually(labelled, 30, f"/metrics labelled with replicas {ids}")


def test_killed_replicas_are_replaced_and_service_goes_on(cluster: Cluster) -> None:
    # Model b: kill its engine core process; the replica turns unhealthy and Serve
    # replaces it. Model a: kill one replica's actor; the survivor takes the traffic.
    handle = serve.get_deployment_handle("LLMServer:b", app_name="slotserve")
    b_old = handle.describe.remote().result(timeout_s=30)
    os.kill(b_old["engine_pid"], 9)
    a_first = complete(cluster, SHARED + " kill")[0]
    name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].endswith("#" + a_first))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # New requests on a are answered at once (by the survivor, or a retried one).
    served = {complete(cluster, SHARED + f" after {i}")[0] for i in range(4)}
    assert a_first not in served

    def b_replaced() -> bool:
        try:
            replica, _ = complete(cluster, "after the crash", model="b")
        except openai.APIStatusError as exc:
            assert exc.status_code >= 500  # never a 4xx for a dead replica
            return False
        return replica != b_old["replica_id"]

    eventually(b_replaced, 120, "a new replica of b answers")

    rounds = iter(range(1000))

    def a_replaced() -> bool:
        k = next(rounds)
        ids = {complete(cluster, f"fresh {k} {i} " * 6)[0] for i in range(4)}
        return len(ids) == 2 and a_first not in ids

    eventually(a_replaced, 120, "a new replica of a answers")


def test_stop_leaves_no_ray_process(cluster: Cluster) -> None:
    cluster.stop()
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == []
