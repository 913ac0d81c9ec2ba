"""LLMServer: one engine replica of a Ray Serve deployment.

Each replica runs its own AsyncLLM (the engine core in a child process) and the one-process
OpenAI app of `entrypoints/openai/api_server.py` in process, so a replica answers a forwarded
HTTP request exactly as `slotserve serve` would (same validation, same 4xx bodies, SSE,
tools, structured outputs): the ingress forwards the request's method, path, headers and body
(a completion's text prompt already as token ids) and streams back what the app sends, with
the replica's id in `x-slotserve-replica`. Ray Serve calls `check_health` (a dead engine core
makes the replica unhealthy, so Serve replaces it) and `record_routing_stats` (what this
replica's prefix cache holds, its queue and its metrics, for the router and `/metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.errors import EngineDeadError

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


async def call_asgi(app: Any, method: str, path: str, query: bytes,
                    headers: list[tuple[bytes, bytes]], body: bytes,
                    client: tuple[str, int]) -> AsyncIterator[dict[str, Any]]:
    """Drive the ASGI app in process and yield the messages it sends (start, body parts)."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    delivered = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query, "root_path": "", "headers": headers,
             "client": client, "server": ("slotserve-replica", 0)}

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
    finally:
        gone.set()  # the ingress went away (or we are done): the app sees a disconnect
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class LLMServer:
    """The deployment class (wrapped with `serve.deployment` in `slotserve.ray.app`)."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str,
                 threads: int | None = None, limits: ServerLimits | None = None,
                 tool_call_parser: str | None = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncLLM.from_engine_args(engine_mode="process", threads=threads,
                                                **engine_kwargs)
        self.app = build_app(self.engine, served_model_names=[served_model_name],
                             limits=limits, shutdown_engine=False,
                             tool_call_parser=tool_call_parser)
        self.metrics = self.engine.metrics
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

    def describe(self) -> dict[str, Any]:
        """Who this replica is and its engine core's process id (for operators and tests)."""
        return {"replica_id": self.replica_id,
                "engine_pid": getattr(self.engine.engine.engine_core, "pid", None)}

    async def handle_http(self, block_hashes: list[bytes], method: str, path: str,
                          query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                          client: tuple[str, int] = ("ray-serve-ingress", 0)
                          ) -> AsyncIterator[dict[str, Any]]:
        """The app's ASGI messages for one request (`block_hashes` are the router's;
        `client` is the caller's address, which admission control tells clients apart by)."""
        if self.engine.errored:
            raise ReplicaUnavailable(self.replica_id)
        async for message in call_asgi(self.app, method, path, query, headers, body, client):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REPLICA_HEADER.encode(),
                                                   self.replica_id.encode())]}
            yield message

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
