"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` returns the FastAPI app.

Request bodies are read and validated here (size limit, JSON, strict pydantic models) rather
than by FastAPI's body machinery, so every failure maps to one OpenAI-style 4xx and nothing
malformed reaches the engine.
"""

from __future__ import annotations

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
from starlette.types import ASGIApp, Receive, Scope, Send

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.errors import (
    APIError,
    bad_request,
    from_pydantic_errors,
    install_exception_handlers,
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
from slotserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
M = TypeVar("M", bound=BaseModel)


def slotserve_version() -> str:
    try:
        return metadata.version("slotserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class APIKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer KEY` (HTTP and WebSocket)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        # Constant time, so the comparison leaks nothing about how much of the key matched.
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = APIError(401, "Incorrect or missing API key (send Authorization: Bearer "
                            "KEY).", code="invalid_api_key").response()
        await response(scope, receive, send)


async def read_body(raw: Request, limit: int) -> bytes:
    """The request body, refusing it (413) as soon as it is known to exceed `limit`."""
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    parts: list[bytes] = []
    size = 0
    async for part in raw.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                           code="request_too_large")
        parts.append(part)
    return b"".join(parts)


async def parse_body(raw: Request, model: type[M], limit: int) -> M:
    body = await read_body(raw, limit)
    if not body.strip():
        raise bad_request("the request body is empty; a JSON object is expected", None,
                          "invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_pydantic_errors(exc.errors()) from exc


def build_app(engine: AsyncLLM, *, served_model_names: Sequence[str],
              api_key: str | None = None, metrics: ServerMetrics | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_engine: bool = True, tool_call_parser: str | None = None) -> FastAPI:
    """`tool_call_parser` names the tool-call format (hermes, llama3_json) when the chat
    template does not show one."""
    names = list(served_model_names)
    if metrics is None:
        metrics = engine.metrics if engine.metrics is not None else ServerMetrics(names[0])
        engine.metrics = metrics
    completion = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, tool_call_parser)
    sessions = OpenAIServingSessions(engine, names)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="slotserve", version=slotserve_version(), lifespan=lifespan)
    install_exception_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return APIError(503, f"the engine is dead: {engine.dead_error}",
                            code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": slotserve_version()})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(ModelList(data=[
            ModelCard(id=n, root=n, max_model_len=engine.max_model_len) for n in names]))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await parse_body(raw, CompletionRequest, max_body_bytes)
        return await completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await parse_body(raw, ChatCompletionRequest, max_body_bytes)
        return await chat.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        req = await parse_body(raw, TokenizeRequest, max_body_bytes)
        completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = render_chat(engine.tokenizer, req.messages,
                                 add_generation_prompt=req.add_generation_prompt)
        else:
            tokens = engine.tokenize(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return json_response(TokenizeResponse(count=len(tokens), tokens=tokens,
                                              max_model_len=engine.max_model_len))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await parse_body(raw, DetokenizeRequest, max_body_bytes)
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: str = "false") -> Response:
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

    @app.websocket("/v1/sessions")
    async def session(ws: WebSocket) -> None:
        await sessions.handle(ws)

    return app
