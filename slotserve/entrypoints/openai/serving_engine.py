"""What the completion and chat handlers share: model checks, request preparation, logprobs,
SSE framing, client-disconnect handling and fan-in of several generators."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from slotserve.core.outputs import LogprobsEntry
from slotserve.engine.processor import ProcessedRequest
from slotserve.entrypoints.async_llm import AsyncLLM, RequestFailedError
from slotserve.entrypoints.openai.admission import AdmissionController, Ticket, client_key
from slotserve.entrypoints.openai.errors import (
    APIError,
    ClientGone,
    bad_request,
    engine_dead,
    from_exception,
)
from slotserve.entrypoints.openai.lora_models import LoRAModels
from slotserve.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from slotserve.entrypoints.openai.stream_interval import StreamInterval
from slotserve.errors import EngineDeadError
from slotserve.outputs import CompletionOutput, RequestOutput
from slotserve.sampling_params import SamplingParams

T = TypeVar("T")
# (prompt index, delta output) from every engine request behind one API request.
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]
# Prompts in one completions request; each becomes its own engine request (times n), and
# the sequences of one request (prompts x n) are bounded as well.
MAX_PROMPTS_PER_REQUEST = 256
MAX_SEQS_PER_REQUEST = 256


@dataclass(slots=True)
class ChoiceState:
    """What one choice (prompt i, sequence j) has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    text_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_sent: bool = False

    def add(self, c: CompletionOutput, keep: bool) -> None:
        """Fold one delta in; `keep` stores text and tokens (non-streaming responses)."""
        self.num_tokens += len(c.token_ids)
        if keep:
            self.text_parts.append(c.text)
            self.token_ids.extend(c.token_ids)
            if c.logprobs:
                self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None and self.finish_reason is None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 admission: AdmissionController | None = None) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.max_model_len = engine.max_model_len
        self.admission = admission
        engine.processor.clip_max_tokens = False  # the API refuses what it would clip
        self._token_text: dict[int, str] = {}
        # The adapters a request's `model` may name (api_server sets it).
        self.loras: LoRAModels | None = None
        # SSE writes batch this many engine outputs after the first (api_server sets it).
        self.stream_interval = 1

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.served_model_names[0]
        if self.loras is not None and model in self.loras.adapters:
            return model
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return model

    def prepare(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams,
                request_id: str, priority: int, model: str | None = None) -> ProcessedRequest:
        """Validate and tokenize one prompt; raises before anything reaches the engine.
        `model`: the request's, which may name an adapter."""
        if self.engine.errored:
            # New work gets 503 once the engine is dead (requests it was running got 500).
            raise engine_dead(503)
        lora = self.loras.resolve(model) if self.loras is not None else None
        return self.engine.process_request(prompt, params, request_id, priority=priority,
                                           lora_request=lora)

    # ----- admission ---------------------------------------------------------------------------

    @staticmethod
    def client_of(raw: Request, user: str | None) -> str:
        return client_key(user, raw.client.host if raw.client is not None else None)

    async def precheck(self, raw: Request, user: str | None) -> None:
        """429 before tokenizing when the client has no room left at all."""
        if self.admission is not None:
            client = self.client_of(raw, user)
            await self._refusing(client, self.admission.precheck, client)

    async def _refusing(self, client: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args); a 429 it raises is held back if the client was refused a moment ago."""
        assert self.admission is not None
        try:
            return fn(*args)
        except APIError as exc:
            if exc.status == 429:
                delay = self.admission.refusal_delay(client)
                if delay:
                    await asyncio.sleep(delay)
            raise

    async def admit(self, raw: Request, user: str | None,
                    processed: Sequence[ProcessedRequest]) -> Ticket | None:
        """Wait for this request's turn (admission.py); raises a 429 APIError past the
        bounds; raises ClientGone when the client went away meanwhile."""
        if self.admission is None:
            return None
        seqs = sum(len(p.requests) for p in processed)
        tokens = sum(len(r.prompt_token_ids) + (r.sampling_params.max_tokens or 0)
                     for p in processed for r in p.requests)
        client = self.client_of(raw, user)
        ticket = await self._refusing(client, self.admission.admit, client, seqs, tokens)
        if await until_disconnected(raw, self.admission.wait(ticket)) is None:
            self.admission.finished(ticket)
            raise ClientGone()
        return ticket

    async def respond_admitted(self, raw: Request, req: Any, processed: Any, request_id: str,
                               model: str, ticket: Ticket | None, outputs: Outputs) -> Response:
        """respond(), with the ticket marked started at the first output and finished at
        the end (also when the outputs were never read: a client gone at once)."""
        if ticket is None or self.admission is None:
            return await self.respond(raw, req, processed, request_id, model, outputs)
        try:
            return await self.respond(raw, req, processed, request_id, model,
                                      self.admission.track(ticket, outputs))
        finally:
            if ticket.state == "released":
                self.admission.finished(ticket)

    # ----- logprobs ---------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.detokenize([token_id])
            self._token_text[token_id] = text
        return text

    @staticmethod
    def top_entries(entry: LogprobsEntry, num: int) -> list[tuple[int, float]]:
        if num <= 0:
            return []
        return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num]

    # ----- responses --------------------------------------------------------------------------

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))

    def _frames(self, req: Any, processed: Any, request_id: str, created: int, model: str,
                first: tuple[int, RequestOutput], rest: Outputs) -> AsyncIterator[str]:
        """The SSE strings of a streamed response (each endpoint defines its own)."""
        raise NotImplementedError

    async def _collect(self, req: Any, processed: Any, request_id: str, created: int,
                       model: str, outputs: Outputs) -> BaseModel:
        """The body of a response that is not streamed (each endpoint defines its own)."""
        raise NotImplementedError

    async def respond(self, raw: Request, req: Any, processed: Any, request_id: str,
                      model: str, outputs: Outputs) -> Response:
        """SSE frames when `req.stream`, else one JSON body; 499 once the client has gone."""
        created = int(time.time())
        if req.stream:
            response = await self.stream(raw, outputs, lambda first, rest: self._frames(
                req, processed, request_id, created, model, first, rest))
            return response if response is not None else Response(status_code=499)
        try:
            result = await until_disconnected(
                raw, self._collect(req, processed, request_id, created, model, outputs))
        except Exception as exc:
            raise to_api_error(exc) from exc
        if result is None:
            return Response(status_code=499)
        return json_response(result)

    async def sse_frames(self, opening: list[str], first: tuple[int, RequestOutput],
                         rest: Outputs, frames_for: Callable[[int, RequestOutput], list[str]],
                         usage: Callable[[], str]) -> AsyncIterator[str]:
        """One write per engine output (each socket send costs more than building the JSON),
        or with --stream-interval N one per N of them after the first (StreamInterval); what
        is held, and the usage event when asked for, go out together with [DONE]."""
        interval = StreamInterval(self.stream_interval)
        held: list[str] = []
        tail = ""
        try:
            held = opening + frames_for(*first)
            if interval.due(1 if held else 0):
                yield "".join(held)
                held = []
            async for i, out in rest:
                if frames := frames_for(i, out):
                    held += frames
                    if interval.due(1):
                        yield "".join(held)
                        held = []
            tail = usage()
        except Exception as exc:  # noqa: BLE001 - reported in-stream after the 200
            tail = stream_error(exc)
        finally:
            await rest.aclose()
        yield "".join(held) + tail + SSE_DONE

    async def stream(self, raw: Request, outputs: Outputs,
                     frames: Any) -> Any:
        """Start an SSE response once the first output exists.

        Waiting for it means a request that fails before producing anything still gets a
        proper status code and error body instead of a 200 stream with an error inside.
        `frames(first, outputs)` yields the SSE strings.
        """
        first = await until_disconnected(raw, anext(outputs, None))
        if first is None:
            await outputs.aclose()
            return None
        return ClosingStreamingResponse(frames(first, outputs), media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache"})


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator.

    Starlette stops iterating when the client goes away but leaves the generator to the GC;
    closing it at once runs the generators' `finally`, which aborts the engine requests.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def sse(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"
    import json

    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def json_response(payload: BaseModel, status: int = 200) -> Response:
    return Response(payload.model_dump_json(), status_code=status, media_type="application/json")


def stream_error(exc: BaseException) -> str:
    """An error that happens after the 200 was sent travels as an SSE event (as in vLLM)."""
    return sse(to_api_error(exc).body())


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, RequestFailedError):
        # What failed is in the server's log under this request id, not in the response.
        return APIError(500, f"request {exc.request_id} failed in the model step",
                        code="model_step_failed")
    if isinstance(exc, EngineDeadError):
        return engine_dead(500)
    return from_exception(exc)


async def until_disconnected(raw: Request, awaitable: Awaitable[T]) -> T | None:
    """Await `awaitable` unless the client disconnects first (then cancel it, return None).

    Cancelling runs the engine generators' `finally`, which aborts their requests.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return None


async def _wait_disconnect(raw: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def merge_generators(
        generators: list[AsyncGenerator[RequestOutput, None]]) -> Outputs:
    """Interleave several output generators as (generator index, output)."""
    if len(generators) == 1:
        gen = generators[0]
        try:
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = (
        asyncio.Queue())

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, None, exc))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_prompt_count(count: int) -> None:
    if count > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {count}",
                          "prompt")


def check_sequence_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQS_PER_REQUEST:
        raise bad_request(f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; at "
                          f"most {MAX_SEQS_PER_REQUEST} per request", "n")
