"""What the ingress sends on between clients and replicas: a replica's HTTP answer as it
streams (`Relay`), a WebSocket session to the one replica that runs it (`relay_session`),
an admin request to every replica (`fan_out`), and the replicas' metrics as one exposition."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any, cast

from fastapi import WebSocket
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send

from slotserve.entrypoints.openai.errors import APIError
from slotserve.ray.outbox import OUTBOXED, Mux
from slotserve.ray.server import REPLICA_HEADER, ends

logger = logging.getLogger(__name__)
# A pinned call (a session's message, an admin request) waits this long for its replica.
PINNED_CALL_TIMEOUT_S = 60.0
REPLICA_GONE = (RayActorError, ActorUnavailableError)


class Relay(Response):
    """Sends a replica's answer on as it comes (SSE streams through): the first batch came
    back on the answer's own call (`rest`), the later ones arrive through the replica's
    outbox (`outbox.py`), and `rest` ends by saying how many there were."""

    def __init__(self, first: list[dict[str, Any]],
                 rest: DeploymentResponseGenerator[list[dict[str, Any]]], mux: Mux,
                 stream_id: str) -> None:
        self._first, self._rest, self._mux, self._stream_id = first, rest, mux, stream_id
        self.status_code = first[0]["status"]
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            for message in self._first:
                await send(message)
            if not ends(self._first[-1]):
                await self._rest_of_it(send)
        except REPLICA_GONE:
            # The replica died mid-answer: what was sent stays sent; an SSE client gets an
            # error event, then the stream ends.
            error = APIError(500, "the replica serving this request died", code="replica_died")
            await send({"type": "http.response.body", "more_body": False,
                        "body": f"data: {json.dumps(error.body())}\n\n".encode()})
        finally:
            self._mux.unregister(self._stream_id)

    async def _rest_of_it(self, send: Send) -> None:
        queue = self._mux.queues[self._stream_id]
        headers = dict(self._first[0].get("headers", ()))
        replica = headers[REPLICA_HEADER.encode()].decode()

        async def watch() -> None:  # this answer's own call: its count, its end, its failure
            try:
                async for batch in self._rest:
                    queue.put_nowait(batch)
                queue.put_nowait([{"type": "slotserve.done"}])
            except Exception as exc:  # noqa: BLE001 - handed to the relay
                queue.put_nowait([{"type": "slotserve.failed", "error": exc}])

        watcher = asyncio.create_task(watch())
        got, expected = 0, None
        try:
            with self._mux.streaming(replica):
                while expected is None or got < expected:
                    batch = await queue.get()
                    kind = batch[0]["type"]
                    if kind == OUTBOXED:
                        expected = batch[0]["count"]
                    elif kind == "slotserve.done":  # nothing went to the outbox
                        expected = got if expected is None else expected
                    elif kind == "slotserve.failed":
                        raise batch[0]["error"]
                    else:
                        got += 1
                        for message in batch:
                            await send(message)
        finally:
            if not watcher.done():
                watcher.cancel()
                self._rest.cancel()


async def relay_session(ws: WebSocket, handle: DeploymentHandle, max_message_bytes: int,
                        client: tuple[str, int]) -> None:
    """One WebSocket session, relayed as raw ASGI messages to the replica the router picks
    for it; every later message goes to that replica (its KV lives there) until either side
    closes. A replica that dies ends the session with 1011."""
    await ws.receive()  # the connect message: the replica's app gets its own
    conn_id = uuid.uuid4().hex
    scope = ws.scope
    stream = cast(DeploymentResponseGenerator[dict[str, Any]],
                  handle.options(stream=True).handle_ws.remote(
                      [], conn_id, scope["path"], scope.get("query_string", b""),
                      list(scope["headers"]), client))
    try:
        replica = (await stream.__anext__())["replica_id"]
    except REPLICA_GONE:
        await ws.close(code=1011)
        return

    async def inbound() -> None:
        while True:
            message = await ws.receive()
            size = len(message.get("text") or message.get("bytes") or b"")
            if size > max_message_bytes:  # what uvicorn's ws_max_size does in one process
                message = {"type": "websocket.disconnect", "code": 1009}
                await ws.close(code=1009)
            sent = handle.ws_receive.remote(replica, conn_id, message)
            alive = await asyncio.wait_for(sent, PINNED_CALL_TIMEOUT_S)
            if message["type"] == "websocket.disconnect" or not alive:
                return

    pump = asyncio.create_task(inbound())
    try:
        async for message in stream:
            await ws.send(message)
    except REPLICA_GONE:
        logger.warning("replica %s died during session %s", replica, conn_id)
        await ws.close(code=1011)
    except RuntimeError:  # the client is gone: the replica's app has seen its disconnect
        pass
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)


async def fan_out(replicas: list[str],
                  call: Callable[[str], DeploymentResponseGenerator[list[dict[str, Any]]]]
                  ) -> Response:
    """The same request on every replica (an admin request: each holds its own cache and
    adapters): the first failure's answer if any failed, else the first replica's."""
    if not replicas:
        return APIError(503, "no replica is running", code="replica_died").response()

    async def one(replica: str) -> Response:
        stream = call(replica)
        start, body = None, b""
        async for batch in stream:
            for message in batch:
                if message["type"] == "http.response.start":
                    start = message
                else:
                    body += message.get("body", b"")
        assert start is not None
        headers = {k.decode(): v.decode() for k, v in start.get("headers", ())
                   if k.lower() not in (b"content-length", REPLICA_HEADER.encode())}
        return Response(body, status_code=start["status"], headers=headers)

    async def bounded(replica: str) -> Response:
        try:
            return await asyncio.wait_for(one(replica), PINNED_CALL_TIMEOUT_S)
        except (*REPLICA_GONE, TimeoutError):
            return APIError(503, f"replica {replica} did not answer",
                            code="replica_died").response()

    # One after the other: Ray gives concurrent calls made while serving one request the same
    # internal request id, and its router then hands a replica to the wrong one of them.
    answers = [await bounded(r) for r in replicas]
    answer = next((a for a in answers if a.status_code >= 300), answers[0])
    answer.headers[REPLICA_HEADER] = ",".join(replicas)
    return answer


ROUTER_LOAD = "slotserve:router_requests_in_flight"


def render_metrics(reports: dict[str, dict[str, dict[str, Any]]],
                   loads: dict[str, dict[str, int]] | None = None) -> bytes:
    """Every replica's exposition merged into one, each sample labelled with its model and
    replica (one HELP/TYPE per family), and the ingress router's own load term per replica."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    if loads:
        families[ROUTER_LOAD] = ("gauge", "Requests the ingress's router has in flight on the "
                                 "replica (the load term of its ranking).", [
            f'{ROUTER_LOAD}{{model="{_escape(model)}",replica="{_escape(rid)}"}} {n}'
            for model, per in sorted(loads.items()) for rid, n in sorted(per.items())])
    for model, replicas in sorted(reports.items()):
        for replica_id, stats in sorted(replicas.items()):
            for fam in text_string_to_metric_families(stats.get("metrics", "")):
                entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
                for s in fam.samples:
                    labels = {**s.labels, "model": model, "replica": replica_id}
                    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                    entry[2].append(f"{s.name}{{{text}}} {s.value!r}")
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples]
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")

