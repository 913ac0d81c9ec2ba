"""Routes of the web page (`/` and its two assets) and of `GET /v1/engine/state`.

The state is the core's snapshot (`EngineCore.get_engine_state`, taken between two steps)
plus what only the front knows: the token counters and the admission queues per client. It
carries ids and counts, never prompt or output text. The page's files are public (they hold
no secret; the page asks for the API key itself); the state is behind the key like every
other path.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from slotserve.engine.engine_state import SlotState
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.admission import AdmissionController
from slotserve.entrypoints.openai.errors import engine_dead

# The page's files: path -> (file name in this package, media type).
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset(ASSETS)
# Only this origin's own files and endpoints: the page works offline and runs no inline code.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def webui_router(needs_key: bool) -> APIRouter:
    """The page's files; `needs_key` tells the page to ask for the API key before its first
    request (rather than after a 401, which the browser would log as an error)."""
    router = APIRouter()
    package = resources.files(__package__)
    for path, (name, media_type) in ASSETS.items():
        body = package.joinpath(name).read_bytes()
        if name == "index.html":
            body = body.replace(b"{{AUTH}}", b"key" if needs_key else b"none")
        router.add_api_route(path, _asset(body, media_type), methods=["GET"],
                             include_in_schema=False)
    return router


def _asset(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return asset


def admission_view(admission: AdmissionController) -> dict[str, Any]:
    """The front's queue and each client's share of it and of the engine's slots."""
    clients = set(admission.by_client) | set(admission.in_engine) | set(admission.queues)
    rows = []
    for client in sorted(clients):
        waiting = admission.by_client.get(client)
        rows.append({
            "client": client,
            "queued": len(admission.queues.get(client, ())),
            "waiting_seqs": waiting.seqs if waiting else 0,
            "waiting_tokens": waiting.tokens if waiting else 0,
            "in_engine_seqs": admission.in_engine.get(client, 0),
        })
    return {
        "queued": sum(len(q) for q in admission.queues.values()),
        "waiting_seqs": admission.waiting.seqs,
        "waiting_tokens": admission.waiting.tokens,
        "max_waiting_seqs": admission.max_waiting_seqs,
        "max_waiting_tokens": admission.max_waiting_tokens,
        "client_max_seqs": admission.client_max_seqs,
        "client_max_tokens": admission.client_max_tokens,
        "client_max_slots": admission.client_max_slots,
        "num_refused": admission.num_refused,
        "clients": rows,
    }


def _slot_json(slot: SlotState | None, index: int) -> dict[str, Any]:
    # By hand, not dataclasses.asdict (which deep-copies): 256 of these per poll.
    if slot is None:
        return {"index": index, "status": "free", "request_id": None, "num_tokens": None,
                "num_output_tokens": None}
    return {"index": index, "status": slot.status, "request_id": slot.request_id,
            "num_tokens": slot.num_tokens, "num_output_tokens": slot.num_output_tokens}


def engine_state_router(engine: AsyncLLM, admission: AdmissionController) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/engine/state")
    async def engine_state() -> Response:
        if engine.errored:
            return engine_dead(503).response()
        core = await engine.call_utility("get_engine_state")
        front = engine.engine.output_processor
        held = {s.index: s for s in core.held_slots}
        slots = [_slot_json(held.get(i), i) for i in range(core.max_num_seqs)]
        fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(core)
                  if f.name != "held_slots"}
        return JSONResponse({
            "object": "engine.state",
            "time": time.time(),
            **fields,
            "slots": slots,
            "prompt_tokens_total": front.num_prompt_tokens_total,
            "generation_tokens_total": front.num_generation_tokens_total,
            "admission": admission_view(admission),
        })

    return router
