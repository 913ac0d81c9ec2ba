"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` returns the FastAPI app.

Request bodies are read and validated here (size limit, read deadline, JSON, strict pydantic
models) rather than by FastAPI's body machinery, so every failure maps to one OpenAI-style 4xx
and nothing malformed reaches the engine. The server's limits are `limits.ServerLimits`
(`limits.uvicorn_config` applies the connection-level ones); completions and chat go through
admission control (`admission.py`). Administrative endpoints (`/reset_prefix_cache`) exist
only when enabled, and then need the admin key (or the API key when there is no admin key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import metadata
from typing import TypeVar

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.admission import AdmissionController, default_bounds
from slotserve.entrypoints.openai.body import decode_large_body
from slotserve.entrypoints.openai.errors import (
    APIError,
    ClientGone,
    bad_request,
    engine_dead,
    from_pydantic_errors,
    install_exception_handlers,
)
from slotserve.entrypoints.openai.limits import ServerLimits, default_max_body_bytes
from slotserve.entrypoints.openai.lora_models import (
    LORA_ADMIN_PATHS,
    LoRAModels,
    add_lora_routes,
)
from slotserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from slotserve.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat
from slotserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from slotserve.entrypoints.openai.serving_engine import json_response
from slotserve.entrypoints.openai.sessions import OpenAIServingSessions
from slotserve.entrypoints.openai.stream_interval import check_stream_interval
from slotserve.entrypoints.openai.webui.router import (
    PUBLIC_PATHS,
    engine_state_router,
    webui_router,
)
from slotserve.errors import ConfigError
from slotserve.gc_freeze import freeze_long_lived, thaw
from slotserve.lora.request import LoRARequest
from slotserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
# Off unless enabled (--enable-admin-endpoints); they need the admin key, not just any client's.
ADMIN_PATHS = frozenset({"/reset_prefix_cache"}) | LORA_ADMIN_PATHS
# Bodies larger than this are parsed off the event loop.
OFF_LOOP_BODY_BYTES = 256 * 1024


def slotserve_version() -> str:
    try:
        return metadata.version("slotserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def key_matches(scope: Scope, key: str) -> bool:
    given = next((bytes(value) for name, value in scope.get("headers", ())
                  if name == b"authorization"), b"")
    # Constant time, so the comparison leaks nothing about how much of the key matched.
    return hmac.compare_digest(given, f"Bearer {key}".encode())


class APIKeyMiddleware:
    """Every path but /health, the web page's files (`public_paths`) and the admin paths
    (which check their own key) needs `Authorization: Bearer KEY` (HTTP and WebSocket)."""

    def __init__(self, app: ASGIApp, api_key: str,
                 public_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self._key = api_key
        self._public = public_paths | {"/health"} | ADMIN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if (scope["type"] not in ("http", "websocket") or path in self._public
                or key_matches(scope, self._key)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = APIError(401, "Incorrect or missing API key (send Authorization: Bearer "
                            "KEY).", code="invalid_api_key").response()
        await response(scope, receive, send)


async def read_body(raw: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refusing it (413) as soon as it is known to exceed `limit`, and
    (408) when it has not arrived within `timeout_s` (a slow upload holds a connection and
    a buffer). A client that leaves mid-upload ends the request quietly (ClientGone)."""
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in raw.stream():
                size += len(part)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                                   code="request_too_large")
                parts.append(part)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(parts)


async def parse_body(raw: Request, model: type[M], limits: ServerLimits) -> M:
    """The body as `model`. A large one is decoded on a thread of its own (openai.body): a
    6 MB list of 800,000 ints takes 60 ms to validate, which the event loop should not wait,
    nor the threads that tokenize."""
    body = await read_body(raw, limits.body_limit, limits.timeout_request_read_s)
    if not body.strip():
        raise bad_request("the request body is empty; a JSON object is expected", None,
                          "invalid_json")
    try:
        if len(body) > OFF_LOOP_BODY_BYTES:
            return await decode_large_body(model, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_pydantic_errors(exc.errors()) from exc


def make_admission(engine: AsyncLLM, limits: ServerLimits) -> AdmissionController:
    sched = engine.engine.config.scheduler_config
    seqs, tokens = default_bounds(sched.max_num_seqs, sched.max_num_batched_tokens,
                                  sched.max_model_len)
    # The engine's own waiting queue is FCFS: keeping it short (a quarter of the slots' worth
    # of sequences that have not started) leaves the order to the front's round-robin.
    return AdmissionController(limits.max_waiting_seqs or seqs,
                               limits.max_waiting_tokens or tokens, limits.max_client_share,
                               core_window=max(4, sched.max_num_seqs // 4),
                               num_slots=sched.max_num_seqs)


def build_app(engine: AsyncLLM, *, served_model_names: Sequence[str],
              api_key: str | None = None, metrics: ServerMetrics | None = None,
              limits: ServerLimits | None = None, enable_admin: bool = False,
              admin_api_key: str | None = None, shutdown_engine: bool = True,
              tool_call_parser: str | None = None, webui: bool = True,
              lora_modules: Sequence[LoRARequest] = (), stream_interval: int = 1) -> FastAPI:
    """The app. `api_key` and `admin_api_key` must not be empty strings (an empty key would
    read as no key: the caller refuses it); the admin endpoints need one of them.
    `tool_call_parser` names the tool-call format (hermes, llama3_json) when the chat
    template does not show one. `webui`: serve the web page at `/` (its files need no key;
    the `/v1/engine/state` it polls is there either way). `lora_modules`: the adapters a
    request's `model` may name (--lora-modules; the engine needs enable_lora).
    `stream_interval`: a stream's SSE events go on in batches of this many after the first
    (--stream-interval; stream_interval.py)."""
    if api_key == "" or admin_api_key == "":
        raise ConfigError("an API key must not be empty")
    check_stream_interval(stream_interval)
    admin_key = admin_api_key or api_key
    if enable_admin and not admin_key:
        raise ConfigError("admin endpoints need a key: give --admin-api-key or --api-key")
    limits = limits or ServerLimits()
    names = list(served_model_names)
    if metrics is None:
        metrics = engine.metrics if engine.metrics is not None else ServerMetrics(names[0])
        engine.metrics = metrics
    admission = make_admission(engine, limits)
    if limits.max_body_bytes is None:
        limits = dataclasses.replace(
            limits, max_body_bytes=default_max_body_bytes(admission.client_max_tokens))
        logger.info("request bodies over %d bytes are refused (1 MiB + 8 bytes for each of "
                    "the %d tokens one client may have waiting, at most 8 MiB; "
                    "--max-request-body-bytes sets it)", limits.max_body_bytes,
                    admission.client_max_tokens)
    metrics.admission = admission
    completion = OpenAIServingCompletion(engine, names, admission)
    chat = OpenAIServingChat(engine, names, admission, tool_call_parser)
    sessions = OpenAIServingSessions(engine, names, admission)
    loras = LoRAModels(engine, names, lora_modules)
    for serving in (completion, chat, sessions):
        serving.loras = loras
        serving.stream_interval = stream_interval

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Serving starts: the app, the engine client and the tokenizer live until exit, so
        # GC passes while requests run need not walk them (gc_freeze).
        freeze_long_lived("server")
        try:
            yield
        finally:
            if shutdown_engine:
                engine.shutdown()
            thaw()

    app = FastAPI(title="slotserve", version=slotserve_version(), lifespan=lifespan)
    install_exception_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           public_paths=PUBLIC_PATHS if webui else frozenset())
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.limits = limits
    app.state.loras = loras

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return engine_dead(503).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": slotserve_version()})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(ModelList(data=[
            *(ModelCard(id=n, root=n, max_model_len=engine.max_model_len) for n in names),
            *(ModelCard(id=a.lora_name, root=a.lora_path, parent=names[0],
                        max_model_len=engine.max_model_len) for a in loras.adapters.values())]))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await parse_body(raw, CompletionRequest, limits)
        return await completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await parse_body(raw, ChatCompletionRequest, limits)
        return await chat.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        req = await parse_body(raw, TokenizeRequest, limits)
        completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = await engine.run_chat_off_loop(
                render_chat, engine.processor, req.messages,
                add_generation_prompt=req.add_generation_prompt)
        else:
            tokens = await engine.run_off_loop(engine.tokenize, req.prompt or "",
                                               add_special_tokens=req.add_special_tokens)
        return json_response(TokenizeResponse(count=len(tokens), tokens=tokens,
                                              max_model_len=engine.max_model_len))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await parse_body(raw, DetokenizeRequest, limits)
        completion.check_model(req.model)
        vocab = engine.processor.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {vocab})", "tokens")
        return json_response(DetokenizeResponse(prompt=engine.detokenize(req.tokens)))

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if not engine.errored:
            metrics.stats = await engine.get_stats()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(engine_state_router(engine, admission))
    if webui:
        app.include_router(webui_router(needs_key=api_key is not None))
    if enable_admin:
        assert admin_key is not None
        _add_admin_routes(app, engine, admin_key)
        add_lora_routes(app, loras, lambda raw: key_matches(raw.scope, admin_key))

    @app.websocket("/v1/sessions")
    async def session(ws: WebSocket) -> None:
        await sessions.handle(ws)

    return app


def _add_admin_routes(app: FastAPI, engine: AsyncLLM, admin_key: str) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request, reset_running_requests: str = "false"
                                 ) -> Response:
        if not key_matches(raw.scope, admin_key):
            return APIError(401, "administrative endpoints need the admin key (send "
                            "Authorization: Bearer ADMIN_KEY).",
                            code="invalid_api_key").response()
        flag = reset_running_requests.strip().lower()
        if flag not in ("true", "false", "1", "0"):
            raise bad_request("reset_running_requests must be true or false",
                              "reset_running_requests")
        ok = await engine.reset_prefix_cache(reset_running_requests=flag in ("true", "1"))
        if not ok:
            return APIError(409, "the prefix cache could not be reset: blocks are in use "
                            "(pass reset_running_requests=true to preempt running requests)",
                            code="prefix_cache_in_use").response()
        return JSONResponse({"success": True})
