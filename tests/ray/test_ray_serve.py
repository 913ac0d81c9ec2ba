"""slotserve on Ray Serve, end to end: a local Ray cluster of 2 CPUs, model `a` on two
replicas (with two LoRA adapters) and model `b` on one (the bundled model, 1 torch thread
each, checkers on, admin endpoints on), driven through the official `openai` client and a
WebSocket client. One cluster serves the whole module (it takes most of a minute to start on
a busy 2-core machine); the last test stops it and checks that no Ray process is left."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from slotserve.engine.args import DEFAULT_MODEL  # noqa: E402
from slotserve.lora import LoRARequest  # noqa: E402
from slotserve.ray import build_app  # noqa: E402
from slotserve.ray.relay import ROUTER_LOAD  # noqa: E402
from slotserve.ray.server import REPLICA_HEADER  # noqa: E402
from tests.lora.conftest import write_adapters  # noqa: E402

pytestmark = pytest.mark.ray
ENGINE = {"max_model_len": 512, "block_size": 16, "num_blocks": 256, "max_num_seqs": 8,
          "check": True, "seed": 0, "device": "cpu", "dtype": "float32"}
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
KEY, ADMIN = "user-key", "admin-key"
RAY_PROCESS_NAMES = ("raylet", "gcs_server")
# A shared prefix of many 16-token blocks (the bundled model's tokenizer is character-level
# enough that this is well over 10 blocks).
SHARED = "ROMEO: But soft, what light through yonder window breaks? It is the east. " * 3


@dataclass
class Cluster:
    base_url: str
    adapters: list[LoRARequest]
    stopped: bool = False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0,
                             timeout=60)

    def post(self, path: str, key: str = KEY, **kw: Any) -> httpx.Response:
        return httpx.post(self.base_url + path, headers={"Authorization": f"Bearer {key}"},
                          timeout=60, **kw)

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
def cluster(tmp_path_factory: pytest.TempPathFactory, ray_turn: None) -> Iterator[Cluster]:
    if _ray_processes():
        pytest.skip("a Ray cluster is already running on this machine")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL)
    adapters, _ = write_adapters(base, Path(tmp_path_factory.mktemp("ray_lora")), seed=5)
    lora = {**ENGINE, **LORA, "lora_modules": [f"{a.lora_name}={a.lora_path}"
                                                for a in adapters[:2]]}
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             logging_level="warning")
    c = Cluster(f"http://127.0.0.1:{port}", adapters)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(models=[
            {"name": "a", "engine_kwargs": lora, "num_replicas": 2, "num_cpus": 0.5},
            {"name": "b", "engine_kwargs": ENGINE, "num_replicas": 1, "num_cpus": 0.5}],
            api_key=KEY, enable_admin=True, admin_api_key=ADMIN),
            name="slotserve", route_prefix="/")
        yield c
    finally:
        c.stop()


def complete(c: Cluster, prompt: str, model: str = "a", **kw: Any) -> tuple[str, str]:
    raw = c.client().completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def eventually(check: Callable[[], bool], timeout: float, what: str,
               explain: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:g} s: {what}; {explain()}")


def _deployment(name: str) -> Any:
    return serve.status().applications["slotserve"].deployments[name]


def deployment_status(name: str) -> str:
    """What Serve says of a deployment: its status, message and replicas per state."""
    d = _deployment(name)
    states = {str(k): v for k, v in d.replica_states.items()}
    return f"Serve: {name} {d.status} {states} {d.message!r}"


def running_replicas(name: str) -> int:
    return sum(v for k, v in _deployment(name).replica_states.items()
               if str(k).endswith("RUNNING"))


def test_models_completions_chat_and_streams_through_openai(cluster: Cluster) -> None:
    client = cluster.client()
    cards = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
    assert cards == {"a": None, "adapter1": "a", "adapter2": "a", "b": None}
    replica, text = complete(cluster, "To be, or not")
    assert replica and isinstance(text, str)
    chat = client.chat.completions.with_raw_response.create(
        model="b", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert chat.headers[REPLICA_HEADER] and chat.parse().choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model="a", prompt="Speak", max_tokens=5,
                                            stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_a_chat_is_rendered_once_at_the_ingress(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    counted = cluster.post("/tokenize", json={"model": "b", "messages": messages}).json()
    chat = cluster.client().chat.completions.create(model="b", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=2)
    assert chat.usage is not None and chat.usage.prompt_tokens == counted["count"]
    # The replica takes the ids it is given and renders nothing itself: ids that are not the
    # messages' rendering are what it runs.
    handle = serve.get_deployment_handle("LLMServer:b", app_name="slotserve")
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    ids = [5, 6, 7]
    stream = handle.options(stream=True).handle_http.remote(
        [], "POST", "/v1/chat/completions", b"", [(b"content-type", b"application/json")],
        body, ("test", 0), ids)
    answer = b"".join(m.get("body", b"") for batch in stream for m in batch)
    assert json.loads(answer)["usage"]["prompt_tokens"] == len(ids) != counted["count"]


def test_same_prefix_sticks_and_different_prefixes_spread(cluster: Cluster) -> None:
    homes = {complete(cluster, SHARED + f" Request {i}.")[0] for i in range(5)}
    assert len(homes) == 1, f"one shared prefix went to several replicas: {homes}"
    spread = {complete(cluster, f"{i} " * 5 + f"unrelated prompt number {i} " * 6)[0]
              for i in range(10)}
    assert len(spread) == 2, f"cold prompts did not spread: {spread}"


def test_a_burst_of_first_requests_all_answer_and_split_evenly(cluster: Cluster) -> None:
    # The ingress's first requests for a model: its tokenizer is loaded once, not once per
    # request at once (transformers' lazy import is not thread safe: 500s). Sent before Ray
    # has confirmed any on a replica, each decision counts at once (Reservations), so they
    # do not herd onto the replica that looked idlest (16 / 16 with them; 13 / 19 without).
    prompts = [f"{i} " * 4 + f"burst prompt {i} " * 6 for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        homes = Counter(pool.map(lambda p: complete(cluster, p, max_tokens=16)[0], prompts))
    assert len(homes) == 2 and min(homes.values()) >= 14, f"a burst herded: {homes}"


def test_bad_input_gets_the_one_process_4xx(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="a", prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    r = cluster.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = cluster.post("/v1/chat/completions", json={"model": "a", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert cluster.post("/v1/completions", key="wrong", json={}).status_code == 401


def test_a_session_stays_on_one_replica(cluster: Cluster) -> None:
    url = cluster.base_url.replace("http://", "ws://") + "/v1/sessions?model=a"
    with connect(url, open_timeout=60,
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        replica = ws.response.headers[REPLICA_HEADER] if ws.response else None
        assert replica and json.loads(ws.recv(timeout=60))["type"] == "session.created"
        for i, text in enumerate(["To be, or not to be,", " that is the question"]):
            ws.send(json.dumps({"type": "input", "prompt": text, "max_tokens": 3,
                                "temperature": 0, "ignore_eos": True}))
            while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
                assert msg["chunk"] == i
            assert msg["type"] == "chunk.done" and msg["usage"]["completion_tokens"] == 3
        ws.send(json.dumps({"type": "end"}))
        done = json.loads(ws.recv(timeout=60))
        assert done["type"] == "session.done" and done["usage"]["completion_tokens"] == 6
    with pytest.raises(InvalidStatus) as refused:  # no API key: refused as by one process
        connect(url, open_timeout=60)
    assert refused.value.response.status_code == 403


def router_loads(cluster: Cluster) -> dict[str, float]:
    """The ingress router's in-flight count per replica of `a`, from /metrics."""
    text = httpx.get(cluster.base_url + "/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.labels["replica"]: s.value
            for f in text_string_to_metric_families(text) if f.name == ROUTER_LOAD
            for s in f.samples if s.labels["model"] == "a"}


def complete_on_each(cluster: Cluster, model: str, word: str) -> dict[str, str]:
    """Cold prompts (new for each `word`) until both replicas of `a` answered: replica ->
    text."""
    texts: dict[str, str] = {}
    for i in range(16):
        replica, text = complete(cluster, f"{i} {word} answer {i}. " * 3, model=model)
        texts.setdefault(replica, text)
        if len(texts) == 2:
            break
    assert len(texts) == 2, (f"cold prompts all went to {texts}; router loads "
                             f"{router_loads(cluster)}; {deployment_status('LLMServer:a')}")
    return texts


def test_adapters_and_admin_requests_reach_every_replica(cluster: Cluster) -> None:
    base, one = complete(cluster, "Speak, adapter")[1], complete(cluster, "Speak, adapter",
                                                                 model="adapter1")[1]
    assert base != one
    third = cluster.adapters[2]
    body = {"lora_name": third.lora_name, "lora_path": third.lora_path}
    assert cluster.post("/v1/load_lora_adapter", json=body).status_code == 401
    loaded = cluster.post("/v1/load_lora_adapter", ADMIN, json=body)
    assert loaded.status_code == 200, loaded.text
    assert len(loaded.headers[REPLICA_HEADER].split(",")) == 2  # both replicas loaded it
    complete_on_each(cluster, "adapter3", "Adapters")  # either replica serves it
    assert any(m.id == "adapter3" for m in cluster.client().models.list().data)
    again = cluster.post("/v1/load_lora_adapter", ADMIN, json=body)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    unloaded = cluster.post("/v1/unload_lora_adapter", ADMIN, json={"lora_name": "adapter3"})
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(cluster, "gone", model="adapter3")
    # Loaded again (under a new id) and left loaded: a replica Serve starts later gets it
    # replayed (the kill test below).
    assert cluster.post("/v1/load_lora_adapter", ADMIN, json=body).status_code == 200
    reset = cluster.post("/reset_prefix_cache?model=a", ADMIN)
    assert reset.status_code == 200 and reset.json() == {"success": True}
    assert len(reset.headers[REPLICA_HEADER].split(",")) == 2


def test_metrics_carry_each_replica(cluster: Cluster) -> None:
    ids = {complete(cluster, f"metrics {i} " * 8)[0] for i in range(6)}

    def labelled() -> bool:
        text = httpx.get(cluster.base_url + "/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"}).text
        return all(f'replica="{r}"' in text for r in ids) and 'model="b"' in text

    eventually(labelled, 30, f"/metrics labelled with replicas {ids}")
    # Every request is done: the router's load term is back to zero on each replica (a
    # count Ray never closed would steer cold requests away from that replica).
    eventually(lambda: set(router_loads(cluster).values()) == {0}, 10,
               "the router's in-flight counts return to 0", lambda: str(router_loads(cluster)))
    assert len(router_loads(cluster)) == 2


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

    # Starting a replica (torch, the model, its engine process) takes seconds here and has
    # taken minutes on a busy CI machine: Serve's own view is waited on first, so a failure
    # says whether Serve replaced the replica or the router did not use the new one.
    explain_b = lambda: deployment_status("LLMServer:b")  # noqa: E731
    eventually(b_replaced, 240, "a new replica of b answers", explain_b)
    explain_a = lambda: deployment_status("LLMServer:a")  # noqa: E731
    eventually(lambda: running_replicas("LLMServer:a") == 2, 240,
               "Serve runs a new replica of a", explain_a)
    rounds = iter(range(1000))
    answered: set[str] = set()

    def a_replaced() -> bool:
        k = next(rounds)
        ids = {complete(cluster, f"fresh {k} {i} " * 6)[0] for i in range(4)}
        answered.update(ids)
        return len(ids) == 2 and a_first not in ids

    eventually(a_replaced, 60, "a new replica of a answers",
               lambda: f"{explain_a()}; answered by {sorted(answered)}")
    # The adapter loaded at run time was replayed onto the new replica.
    assert a_first not in complete_on_each(cluster, "adapter3", "Replayed")


def test_stop_leaves_no_ray_process(cluster: Cluster) -> None:
    cluster.stop()
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == []
