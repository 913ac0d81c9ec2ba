"""LLMServer: one engine replica of a Ray Serve deployment.

Each replica runs its own AsyncLLM (the engine core in a child process) and the one-process
OpenAI app of `entrypoints/openai/api_server.py` in process, so a replica answers a forwarded
HTTP request exactly as `slotserve serve` would (same validation, same 4xx bodies, SSE,
tools, structured outputs): the ingress forwards the request's method, path, headers and body
(a completion's text prompt already as token ids) and streams back what the app sends, with
the replica's id in `x-slotserve-replica`. A chat arrives with its prompt ids as the ingress
rendered them (the app takes them from the ASGI scope instead of rendering again). A
WebSocket session runs here for its whole life (`handle_ws` streams what the app sends,
`ws_receive` takes what the client sends). Ray Serve calls `check_health` (a dead engine core
makes the replica unhealthy, so Serve replaces it) and `record_routing_stats` (what this
replica's prefix cache holds, its queue and its metrics, for the router and `/metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from slotserve.engine.args import EngineArgs
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.entrypoints.openai.lora_models import LoRAModels
from slotserve.entrypoints.openai.serving_chat import PROMPT_IDS_SCOPE_KEY
from slotserve.entrypoints.openai.stream_interval import StreamInterval, check_stream_interval
from slotserve.errors import EngineDeadError
from slotserve.gil_switch import shorten_switch_interval
from slotserve.ray.outbox import Batch, Outbox, split

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-slotserve-replica"
# Block hashes a replica reports at most (the most recently cached ones).
MAX_REPORTED_HASHES = 8192


class ReplicaUnavailable(RuntimeError):
    """This replica cannot serve (its engine core died): the ingress sends the request to
    another replica and the router avoids this one until Serve has replaced it."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica {replica_id}: the engine core has died")
        self.replica_id = replica_id


def ends(message: dict[str, Any]) -> bool:
    return (message["type"] == "websocket.close" or message["type"] == "http.response.body"
            and not message.get("more_body"))


async def drive_asgi(app: Any, scope: dict[str, Any], inbound: asyncio.Queue[dict[str, Any]],
                     disconnect: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
    """Run the ASGI app in process on `scope`, its `receive` reading `inbound`, and yield
    the messages it sends until its response (or socket) is closed: each time, every message
    sent since the last (usually one; a response's start and its body together). When the
    caller stops listening the app receives `disconnect`."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def send(message: dict[str, Any]) -> None:
        sent.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, inbound.get, send)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        done = False
        while not done and (message := await sent.get()) is not None:
            batch = [message]
            while not ends(batch[-1]) and not sent.empty():
                if (more := sent.get_nowait()) is None:
                    break
                batch.append(more)
            done = ends(batch[-1])
            yield batch
    finally:
        inbound.put_nowait(disconnect)  # the ingress went away (or we are done)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def merge_bodies(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive body messages of an HTTP answer as one (their bytes joined)."""
    out: list[dict[str, Any]] = []
    parts: list[bytes] = []
    for m in messages:
        if m["type"] == "http.response.body" and out and out[-1]["type"] == m["type"]:
            parts.append(m.get("body", b""))
            out[-1] = {**m, "body": b""}
            continue
        if parts:
            out[-1]["body"] = b"".join(parts)
        parts = [m.get("body", b"")] if m["type"] == "http.response.body" else []
        out.append(dict(m))
    if parts:
        out[-1]["body"] = b"".join(parts)
    return out


async def coalesced(batches: AsyncIterator[list[dict[str, Any]]], stream_interval: int
                    ) -> AsyncIterator[list[dict[str, Any]]]:
    """An HTTP answer in as few messages as its stream allows, since every message costs a
    Ray handle message, the ingress's relay and the proxy's (most of a streamed token's CPU
    time on 2 cores): the start is held for the first body; the bodies (SSE events) go on as
    `StreamInterval` says (the one-process server's rule too); what was already queued goes
    in one message whatever the interval."""
    held: list[dict[str, Any]] = []
    interval = StreamInterval(stream_interval)
    async for batch in batches:
        held += batch
        if interval.due(sum(m["type"] == "http.response.body" for m in batch),
                        ends(held[-1])):
            yield merge_bodies(held)
            held = []
    if held:
        yield merge_bodies(held)


def pin_engine(core: Any, rank: Any, threads: int) -> list[int]:
    """Bind the engine core process to this replica's own cores: the cores this process
    may use, `threads` for each replica by its rank on the node. Two engines left to the
    scheduler on 2 cores migrate and evict each other's caches: pinned, 2 replicas made
    3-7% more tokens a second (docs/RAY.md). Nothing is pinned when they would not fit."""
    pid = getattr(core, "pid", None)
    local_rank = getattr(rank, "local_rank", None)
    cores = sorted(os.sched_getaffinity(0))
    if pid is None or local_rank is None or (local_rank + 1) * threads > len(cores):
        return []
    mine = cores[local_rank * threads:(local_rank + 1) * threads]
    for task in os.listdir(f"/proc/{pid}/task"):  # threads made later inherit it
        os.sched_setaffinity(int(task), mine)
    logger.info("engine core %d pinned to cores %s", pid, mine)
    return mine


def asgi_scope(kind: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
               client: tuple[str, int], **extra: Any) -> dict[str, Any]:
    scope = {"type": kind, "asgi": {"version": "3.0"}, "http_version": "1.1",
             "scheme": "http" if kind == "http" else "ws", "path": path,
             "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": headers, "client": client, "server": ("slotserve-replica", 0)}
    scope.update(extra)
    return scope


class LLMServer:
    """The deployment class (wrapped with `serve.deployment` in `slotserve.ray.app`)."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str,
                 threads: int | None = None, limits: ServerLimits | None = None,
                 tool_call_parser: str | None = None, enable_admin: bool = False,
                 admin_api_key: str | None = None, stream_interval: int = 1,
                 pin_cores: bool = False) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        shorten_switch_interval()  # as `slotserve serve` does: the front shares a GIL
        self.engine = AsyncLLM.from_engine_args(engine_mode="process", threads=threads,
                                                **engine_kwargs)
        if pin_cores:
            pin_engine(self.engine.engine.engine_core, getattr(context, "rank", None),
                       threads or 1)
        self.app = build_app(self.engine, served_model_names=[served_model_name],
                             limits=limits, shutdown_engine=False,
                             tool_call_parser=tool_call_parser,
                             enable_admin=enable_admin, admin_api_key=admin_api_key,
                             lora_modules=EngineArgs.from_kwargs(**engine_kwargs).lora_requests())
        self.stream_interval = check_stream_interval(stream_interval)
        self.loras: LoRAModels = self.app.state.loras
        self.metrics = self.engine.metrics
        # Open WebSocket sessions on this replica: connection id -> what the client sent.
        self.sockets: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        # Streamed answers' later batches, per caller (an ingress replica's id).
        self.outboxes: dict[str, Outbox] = {}
        cache = self.engine.engine.config.cache_config
        processor = self.engine.processor
        eos = [] if processor.eos_token_id is None else [processor.eos_token_id]
        # What the ingress needs to tokenize and hash as this engine does.
        self.info = {"block_size": cache.block_size, "replica_id": self.replica_id,
                     "max_model_len": self.engine.max_model_len,
                     "prefix_caching": cache.enable_prefix_caching,
                     "vocab_size": processor.vocab_size,
                     "eos_token_ids": eos + processor.extra_stop_token_ids}
        logger.info("replica %s serves %s", self.replica_id, served_model_name)

    def engine_info(self) -> dict[str, Any]:
        return self.info

    def adapters(self) -> dict[str, tuple[int, str]]:
        """The LoRA adapters a request's `model` may name: name -> (lora_int_id, path)."""
        return {a.lora_name: (a.lora_int_id, a.lora_path) for a in self.loras.adapters.values()}

    def describe(self) -> dict[str, Any]:
        """Who this replica is and its engine core's process id (for operators and tests)."""
        return {"replica_id": self.replica_id,
                "engine_pid": getattr(self.engine.engine.engine_core, "pid", None)}

    async def handle_http(self, route: list[bytes] | str, method: str, path: str,
                          query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                          client: tuple[str, int] = ("ray-serve-ingress", 0),
                          prompt_token_ids: list[int] | None = None,
                          outbox: tuple[str, str] | None = None) -> AsyncIterator[Batch]:
        """The app's ASGI messages for one request, in batches (`coalesced`). `route` is the
        router's (the request's block hashes, or the id of the replica it must go to);
        `client` is the caller's address, which admission control tells clients apart by;
        `prompt_token_ids`, a chat's messages as the ingress rendered them (this replica
        does not render again). With `outbox` (the caller's id, this answer's stream id)
        the batches after the first go to that caller's `Outbox`, and the last message
        here says how many went there."""
        if self.engine.errored:
            raise ReplicaUnavailable(self.replica_id)
        extra = {} if prompt_token_ids is None else {PROMPT_IDS_SCOPE_KEY: prompt_token_ids}
        inbound: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        inbound.put_nowait({"type": "http.request", "body": body, "more_body": False})
        scope = asgi_scope("http", path, query, headers, client, method=method, **extra)
        batches = coalesced(drive_asgi(self.app, scope, inbound, {"type": "http.disconnect"}),
                            self.stream_interval)
        if outbox is not None:
            caller, stream_id = outbox
            batches = split(batches, self.outboxes.setdefault(caller, Outbox()), stream_id)
        async for batch in batches:
            yield [self._tagged(m) for m in batch]

    async def drain_outbox(self, route: str, caller: str) -> AsyncIterator[list[tuple[str, Batch]]]:
        """`caller`'s streamed answers' later batches, many per message (`outbox.Mux`)."""
        async for items in self.outboxes.setdefault(caller, Outbox()).drain():
            yield items

    def _tagged(self, message: dict[str, Any]) -> dict[str, Any]:
        """A response's start (an HTTP answer's, a WebSocket's accept) with this replica's id
        in `x-slotserve-replica`."""
        if message["type"] not in ("http.response.start", "websocket.accept"):
            return message
        return {**message, "headers": [*message.get("headers", ()),
                                       (REPLICA_HEADER.encode(), self.replica_id.encode())]}

    async def handle_ws(self, route: list[bytes], conn_id: str, path: str, query: bytes,
                        headers: list[tuple[bytes, bytes]], client: tuple[str, int]
                        ) -> AsyncIterator[dict[str, Any]]:
        """One WebSocket session, for its whole life on this replica (its KV lives here):
        first this replica's id (the ingress pins `ws_receive` calls to it), then what the
        app sends; what the client sends arrives through `ws_receive`."""
        if self.engine.errored:
            raise ReplicaUnavailable(self.replica_id)
        inbound: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        inbound.put_nowait({"type": "websocket.connect"})
        self.sockets[conn_id] = inbound
        try:
            yield {"type": "slotserve.replica", "replica_id": self.replica_id}
            scope = asgi_scope("websocket", path, query, headers, client, subprotocols=[])
            async for batch in drive_asgi(self.app, scope, inbound,
                                          {"type": "websocket.disconnect", "code": 1001}):
                for message in batch:
                    yield self._tagged(message)
        finally:
            del self.sockets[conn_id]

    def ws_receive(self, route: str, conn_id: str, message: dict[str, Any]) -> bool:
        """A client's message for the session `conn_id` (False: it has ended here)."""
        inbound = self.sockets.get(conn_id)
        if inbound is not None:
            inbound.put_nowait(message)
        return inbound is not None

    async def check_health(self) -> None:
        if self.engine.errored:
            raise EngineDeadError(f"replica {self.replica_id}: the engine core died "
                                  f"({self.engine.dead_error})")

    async def record_routing_stats(self) -> dict[str, Any]:
        if self.engine.errored:
            return {"hashes": [], "queue": 0, "metrics": ""}
        hashes, queue = await self.engine.call_utility("get_routing_stats",
                                                       MAX_REPORTED_HASHES)
        assert self.metrics is not None
        self.metrics.stats = await self.engine.get_stats()
        return {"hashes": hashes, "queue": queue, "metrics": self.metrics.render().decode()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
