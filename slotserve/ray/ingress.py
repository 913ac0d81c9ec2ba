"""OpenAIIngress: the one HTTP endpoint in front of every model's replicas.

It answers `/health`, `/version`, `/v1/models` (every model of the app) and `/metrics` (each
replica's slotserve metrics with `model` and `replica` labels) itself, checks the API key,
and forwards everything else to the deployment of the request's `model` (the first model when
none is given) through a handle whose router (`router.py`) picks the replica. A completion's
text prompt is tokenized here, once: the replica receives token ids, and the router the
request's block hashes. A chat's messages are templated here for the hashes (the replica's own
app templates them again). Whatever the ingress cannot read (bad JSON, a bad field) goes to a
replica unchanged, so it gets exactly the 4xx one process gives.
"""


import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send

from slotserve.engine.loading import load_tokenizer
from slotserve.engine.processor import Processor
from slotserve.entrypoints.openai.api_server import key_matches, read_body, slotserve_version
from slotserve.entrypoints.openai.errors import APIError, install_exception_handlers
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, ModelCard, ModelList
from slotserve.entrypoints.openai.serving_chat import render_chat
from slotserve.entrypoints.openai.serving_engine import json_response
from slotserve.ray.server import REPLICA_HEADER, ReplicaUnavailable
from slotserve.ray.state import avoid_replica, replica_reports
from slotserve.routing.policy import request_block_hashes

logger = logging.getLogger(__name__)
# A request whose replica died before it answered anything is sent again, this many times.
MAX_RETRIES = 2

app = FastAPI(title="slotserve")
install_exception_handlers(app)


class _Relay(Response):
    """Sends the replica's ASGI messages on as they come (SSE streams through)."""

    def __init__(self, start: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> None:
        self._start, self._rest = start, rest
        self.status_code = start["status"]
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self._start)
        try:
            async for message in self._rest:
                await send(message)
        except (RayActorError, ActorUnavailableError):
            # The replica died mid-answer: what was sent stays sent; an SSE client gets an
            # error event, then the stream ends.
            error = APIError(500, "the replica serving this request died", code="replica_died")
            await send({"type": "http.response.body", "more_body": False,
                        "body": f"data: {json.dumps(error.body())}\n\n".encode()})
            return
        except asyncio.CancelledError:
            raise


def _render_metrics(reports: dict[str, dict[str, dict[str, Any]]]) -> bytes:
    """Every replica's exposition merged into one, each sample labelled with its model and
    replica (one HELP/TYPE per family)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
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


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, models: dict[str, DeploymentHandle], model_paths: dict[str, str],
                 api_key: str | None = None, limits: ServerLimits | None = None) -> None:
        self.models = models
        self.model_paths = model_paths
        self.default_model = next(iter(models))
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.info: dict[str, dict[str, Any]] = {}
        self.processors: dict[str, Processor] = {}
        # What the ingress answers itself carries its own replica id.
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def _engine(self, model: str) -> tuple[dict[str, Any], Processor]:
        """The model's engine facts (from a replica) and a front processor, made once."""
        if model not in self.processors:
            info = await self.models[model].engine_info.remote()
            tokenizer = await asyncio.to_thread(load_tokenizer, self.model_paths[model])
            self.info[model] = info
            self.processors[model] = Processor(tokenizer, info["max_model_len"],
                                               info["vocab_size"], info["eos_token_ids"])
        return self.info[model], self.processors[model]

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def route(self, path: str, raw: Request) -> Response:
        try:
            response = await self._route("/" + path, raw)
        except APIError as exc:
            response = exc.response()
        if not isinstance(response, _Relay):
            response.headers[REPLICA_HEADER] = self.replica_id
        return response

    async def _route(self, path: str, raw: Request) -> Response:
        if path == "/health":
            return Response(status_code=200)
        if self.api_key and not key_matches(raw.scope, self.api_key):
            return APIError(401, "Incorrect or missing API key (send Authorization: Bearer "
                            "KEY).", code="invalid_api_key").response()
        if path == "/version":
            return JSONResponse({"version": slotserve_version()})
        if path == "/v1/models" and raw.method == "GET":
            cards = []
            for name in self.models:
                info, _ = await self._engine(name)
                cards.append(ModelCard(id=name, root=name, max_model_len=info["max_model_len"]))
            return json_response(ModelList(data=cards))
        if path == "/metrics" and raw.method == "GET":
            return Response(_render_metrics(replica_reports()), media_type=CONTENT_TYPE_LATEST)
        body = await read_body(raw, self.limits.max_body_bytes,
                               self.limits.timeout_request_read_s)
        model, body, hashes = await self._prepare(path, body)
        headers = [(k, v) for k, v in raw.scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        peer = raw.client
        client = (peer.host, peer.port) if peer is not None else ("unknown", 0)
        return await self._forward(model, hashes, raw.method, path,
                                   raw.scope.get("query_string", b""), headers, body, client)

    async def _prepare(self, path: str, body: bytes) -> tuple[str, bytes, list[bytes]]:
        """The request's model, its body for the replica and its block hashes."""
        try:
            doc = json.loads(body) if body.strip() else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return self.default_model, body, []
        model = doc.get("model")
        if model is None or not isinstance(model, str):
            model = self.default_model
        elif model not in self.models:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        info, processor = await self._engine(model)
        if not info["prefix_caching"]:
            return model, body, []
        tokens: list[int] | None = None
        try:
            prompt = doc.get("prompt")
            if path == "/v1/completions" and isinstance(prompt, str):
                tokens = await asyncio.to_thread(processor.tokenize, prompt)
                doc["prompt"] = tokens  # the replica does not tokenize it again
                body = json.dumps(doc).encode()
            elif (path == "/v1/completions" and isinstance(prompt, list) and prompt
                  and all(type(t) is int for t in prompt)):
                tokens = prompt
            elif path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate(doc)
                tokens = await asyncio.to_thread(
                    render_chat, processor, req.messages,
                    add_generation_prompt=req.add_generation_prompt)
        except Exception:  # noqa: BLE001 - the replica answers it with its own 4xx
            logger.debug("ingress could not read the request; forwarded as it is")
        hashes = request_block_hashes(tokens, info["block_size"]) if tokens else []
        return model, body, hashes

    async def _forward(self, model: str, hashes: list[bytes], method: str, path: str,
                       query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                       client: tuple[str, int]) -> Response:
        handle = self.models[model].options(stream=True)
        for attempt in range(MAX_RETRIES + 1):
            stream = cast(DeploymentResponseGenerator[dict[str, Any]], handle.handle_http.remote(
                hashes, method, path, query, headers, body, client))
            try:
                start = await stream.__anext__()
            except (RayActorError, ActorUnavailableError, ReplicaUnavailable) as exc:
                # Nothing was produced yet: another replica may answer it.
                if isinstance(exc, ReplicaUnavailable):
                    # Ray hands a replica's exception back wrapped, its original as `cause`.
                    avoid_replica(model, getattr(exc, "cause", exc).replica_id)
                logger.warning("replica died before answering %s (attempt %d): %s", path,
                               attempt, exc)
                continue
            return _Relay(start, stream)
        return APIError(503, "no replica could answer the request", code="replica_died"
                        ).response()
