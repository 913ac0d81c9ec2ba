"""OpenAIIngress: the one HTTP endpoint in front of every model's replicas.

It answers `/health`, `/version`, `/v1/models` (every model of the app, with its LoRA
adapters) and `/metrics` (each replica's slotserve metrics with `model` and `replica` labels)
itself, checks the API key, and forwards everything else to the deployment of the request's
`model` (a model of the app or one of its adapters; the first model when none is given)
through a handle whose router (`router.py`) picks the replica. A prompt is turned into token
ids here, once: a completion's text is tokenized and a chat's messages are rendered through
the chat template, and the replica receives the ids (it renders nothing again); the router
receives the request's block hashes, keyed by its adapter as the KV cache keys them.
Whatever the ingress cannot read (bad JSON, a bad field) goes to a replica unchanged, so it
gets exactly the 4xx one process gives. A WebSocket session (`/v1/sessions?model=NAME`) stays
on one replica for its life; admin requests (`?model=NAME` picks the model) go to every
replica of the model.
"""

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from slotserve.engine.loading import load_tokenizer
from slotserve.engine.processor import Processor
from slotserve.entrypoints.openai.api_server import (
    ADMIN_PATHS,
    key_matches,
    read_body,
    slotserve_version,
)
from slotserve.entrypoints.openai.errors import APIError, install_exception_handlers
from slotserve.entrypoints.openai.limits import ServerLimits
from slotserve.entrypoints.openai.lora_models import LORA_ADMIN_PATHS
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, ModelCard, ModelList
from slotserve.entrypoints.openai.serving_chat import render_request
from slotserve.entrypoints.openai.serving_engine import json_response
from slotserve.gil_switch import shorten_switch_interval
from slotserve.ray.outbox import Batch, Mux
from slotserve.ray.relay import REPLICA_GONE, Relay, fan_out, relay_session, render_metrics
from slotserve.ray.server import REPLICA_HEADER, ReplicaUnavailable
from slotserve.ray.state import (
    all_router_loads,
    avoid_replica,
    live_replicas,
    replica_reports,
)
from slotserve.routing.policy import request_block_hashes

logger = logging.getLogger(__name__)
# What a replica's `handle_http` streams: its answer's ASGI messages, in batches.
Batches = DeploymentResponseGenerator[list[dict[str, Any]]]
# A request whose replica died before it answered anything is sent again, this many times.
MAX_RETRIES = 2

app = FastAPI(title="slotserve")
install_exception_handlers(app)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, models: dict[str, DeploymentHandle], model_paths: dict[str, str],
                 api_key: str | None = None, limits: ServerLimits | None = None,
                 admin_api_key: str | None = None, enable_admin: bool = False) -> None:
        shorten_switch_interval()  # as `slotserve serve` does: tokenizing shares the GIL
        self.models = models
        self.model_paths = model_paths
        self.default_model = next(iter(models))
        self.api_key = api_key
        # The replicas check the admin key too; the ingress refuses a wrong one up front.
        self.admin_key = (admin_api_key or api_key) if enable_admin else None
        self.limits = limits or ServerLimits()
        self.info: dict[str, dict[str, Any]] = {}
        self.processors: dict[str, Processor] = {}
        # model -> its adapters: name -> (lora_int_id, path), as its replicas hold them.
        self.adapters: dict[str, dict[str, tuple[int, str]]] = {}
        # model -> every LoRA admin request its replicas were sent, in order, and the
        # replicas that have had them: a replica Serve starts later (a replacement, a scale
        # up) gets them replayed before a request of that model is routed, so it holds the
        # same adapters under the same ids (ids are handed out in load order, failures too).
        self.lora_log: dict[str, list[tuple[str, str, bytes, list[tuple[bytes, bytes]],
                                            bytes]]] = {}
        self.synced: dict[str, set[str]] = {}
        self.sync_lock = asyncio.Lock()
        # A burst of first requests would otherwise load the tokenizer once each, at once on
        # several threads, where transformers' lazy import is not thread safe (measured: 500s
        # with "module 'transformers' has no attribute 'PreTrainedTokenizerFast'").
        self.engine_lock = asyncio.Lock()
        # What the ingress answers itself carries its own replica id.
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Per model: streamed answers' later batches, many per message (`outbox.py`).
        self.muxes: dict[str, Mux] = {}

    async def _engine(self, model: str) -> tuple[dict[str, Any], Processor]:
        """The model's engine facts (from a replica) and a front processor, made once."""
        if model not in self.processors:
            async with self.engine_lock:
                if model not in self.processors:
                    await self._make_engine(model)
        return self.info[model], self.processors[model]

    async def _make_engine(self, model: str) -> None:
        info = await self.models[model].engine_info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, self.model_paths[model])
        self.adapters[model] = await self.models[model].adapters.remote()
        self.info[model] = info
        self.processors[model] = Processor(tokenizer, info["max_model_len"],
                                           info["vocab_size"], info["eos_token_ids"])

    async def _resolve(self, name: str | None) -> tuple[str, int | None]:
        """The model (deployment) a request's `model` names and its adapter's id."""
        if name is None or name in self.models:
            return name or self.default_model, None
        for model in self.models:
            await self._engine(model)
            if name in self.adapters[model]:
                return model, self.adapters[model][name][0]
        raise APIError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")

    @app.websocket("/v1/sessions")
    async def session(self, ws: WebSocket) -> None:
        if self.api_key and not key_matches(ws.scope, self.api_key):
            await ws.close(code=1008)
            return
        model = ws.query_params.get("model") or self.default_model
        if model not in self.models:
            await ws.close(code=1008, reason=f"no model {model!r}")
            return
        peer = ws.client
        client = (peer.host, peer.port) if peer is not None else ("unknown", 0)
        await relay_session(ws, self.models[model], self.limits.max_ws_message_bytes, client)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def route(self, path: str, raw: Request) -> Response:
        try:
            response = await self._route("/" + path, raw)
        except APIError as exc:
            response = exc.response()
        if not isinstance(response, Relay) and REPLICA_HEADER not in response.headers:
            response.headers[REPLICA_HEADER] = self.replica_id
        return response

    async def _route(self, path: str, raw: Request) -> Response:
        if path == "/health":
            return Response(status_code=200)
        admin = path in ADMIN_PATHS and self.admin_key is not None
        if admin:
            assert self.admin_key is not None
            if not key_matches(raw.scope, self.admin_key):
                return APIError(401, "administrative endpoints need the admin key (send "
                                "Authorization: Bearer ADMIN_KEY).",
                                code="invalid_api_key").response()
        elif self.api_key and not key_matches(raw.scope, self.api_key):
            return APIError(401, "Incorrect or missing API key (send Authorization: Bearer "
                            "KEY).", code="invalid_api_key").response()
        if path == "/version":
            return JSONResponse({"version": slotserve_version()})
        if path == "/v1/models" and raw.method == "GET":
            return json_response(ModelList(data=await self._model_cards()))
        if path == "/metrics" and raw.method == "GET":
            return Response(render_metrics(replica_reports(), all_router_loads()),
                            media_type=CONTENT_TYPE_LATEST)
        body = await read_body(raw, self.limits.body_limit,
                               self.limits.timeout_request_read_s)
        headers = [(k, v) for k, v in raw.scope["headers"] if k != b"content-length"]
        query = raw.scope.get("query_string", b"")
        if admin:
            return await self._admin(path, raw, query, headers, body)
        model, body, hashes, prompt_ids = await self._prepare(path, body)
        await self._sync_adapters(model)
        headers.append((b"content-length", str(len(body)).encode()))
        peer = raw.client
        client = (peer.host, peer.port) if peer is not None else ("unknown", 0)
        return await self._forward(model, hashes, raw.method, path, query, headers, body,
                                   client, prompt_ids)

    async def _model_cards(self) -> list[ModelCard]:
        cards = []
        for name in self.models:
            info, _ = await self._engine(name)
            cards.append(ModelCard(id=name, root=name, max_model_len=info["max_model_len"]))
            cards += [ModelCard(id=adapter, root=path, parent=name,
                                max_model_len=info["max_model_len"])
                      for adapter, (_, path) in self.adapters[name].items()]
        return cards

    async def _admin(self, path: str, raw: Request, query: bytes,
                     headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
        """An admin request on every replica of the model `?model=` names (the first one by
        default); after a LoRA change the ingress reads the model's adapters again."""
        model = raw.query_params.get("model") or self.default_model
        if model not in self.models:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        await self._engine(model)
        handle = self.models[model].options(stream=True)
        headers = [*headers, (b"content-length", str(len(body)).encode())]

        def call(replica: str) -> Batches:
            return cast(Batches, handle.handle_http.remote(
                replica, raw.method, path, query, headers, body))

        async with self.sync_lock:
            await self._sync_adapters_locked(model)
            # Only replicas that have had the log: one that appeared since gets this request
            # with the log when it is synced.
            replicas = [r for r in live_replicas(model) if r in self.synced[model]]
            answer = await fan_out(replicas, call)
            if path in LORA_ADMIN_PATHS:
                self.lora_log.setdefault(model, []).append(
                    (raw.method, path, query, headers, body))
                self.adapters[model] = await self.models[model].adapters.remote()
        return answer

    async def _sync_adapters(self, model: str) -> None:
        if set(live_replicas(model)) - self.synced.get(model, set()):  # cheap when none
            async with self.sync_lock:
                await self._sync_adapters_locked(model)

    async def _sync_adapters_locked(self, model: str) -> None:
        """Replay the model's LoRA admin requests onto its replicas that have not had them."""
        synced = self.synced.setdefault(model, set())
        fresh = [r for r in live_replicas(model) if r not in synced]
        if not fresh:
            return
        handle = self.models[model].options(stream=True)
        for method, path, query, headers, body in self.lora_log.get(model, ()):
            def call(replica: str, method: str = method, path: str = path, query: bytes = query,
                     headers: list[tuple[bytes, bytes]] = headers, body: bytes = body
                     ) -> Batches:
                return cast(Batches,
                            handle.handle_http.remote(replica, method, path, query, headers,
                                                      body))

            answer = await fan_out(fresh, call)
            logger.info("replayed %s onto %s: %d", path, fresh, answer.status_code)
        synced.update(fresh)

    async def _prepare(self, path: str, body: bytes
                       ) -> tuple[str, bytes, list[bytes], list[int] | None]:
        """The request's model, its body for the replica, its block hashes and (a chat) its
        prompt ids as the chat template renders them."""
        try:
            doc = json.loads(body) if body.strip() else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return self.default_model, body, [], None
        name = doc.get("model")
        model, lora_id = await self._resolve(name if isinstance(name, str) else None)
        info, processor = await self._engine(model)
        tokens: list[int] | None = None
        rendered: list[int] | None = None
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
                tokens = rendered = await asyncio.to_thread(render_request, processor, req)
        except Exception:  # noqa: BLE001 - the replica answers it with its own 4xx
            logger.debug("ingress could not read the request; forwarded as it is")
        hashes = (request_block_hashes(tokens, info["block_size"], lora_int_id=lora_id)
                  if tokens and info["prefix_caching"] else [])
        return model, body, hashes, rendered

    def _mux(self, model: str) -> Mux:
        if model not in self.muxes:
            handle = self.models[model].options(stream=True)
            self.muxes[model] = Mux(
                lambda replica: cast(AsyncIterator[list[tuple[str, Batch]]],
                                     handle.drain_outbox.remote(replica, self.replica_id)),
                lambda replica: replica in live_replicas(model))
        return self.muxes[model]

    async def _forward(self, model: str, hashes: list[bytes], method: str, path: str,
                       query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                       client: tuple[str, int], prompt_ids: list[int] | None) -> Response:
        handle = self.models[model].options(stream=True)
        mux = self._mux(model)
        stream_id = uuid.uuid4().hex
        mux.register(stream_id)
        for attempt in range(MAX_RETRIES + 1):
            stream = cast(Batches, handle.handle_http.remote(
                hashes, method, path, query, headers, body, client, prompt_ids,
                (self.replica_id, stream_id)))
            try:
                start = await stream.__anext__()
            except (*REPLICA_GONE, ReplicaUnavailable) as exc:
                # Nothing was produced yet: another replica may answer it.
                if isinstance(exc, ReplicaUnavailable):
                    # Ray hands a replica's exception back wrapped, its original as `cause`.
                    avoid_replica(model, getattr(exc, "cause", exc).replica_id)
                logger.warning("replica died before answering %s (attempt %d): %s", path,
                               attempt, exc)
                continue
            return Relay(start, stream, mux, stream_id)
        mux.unregister(stream_id)
        return APIError(503, "no replica could answer the request", code="replica_died"
                        ).response()
