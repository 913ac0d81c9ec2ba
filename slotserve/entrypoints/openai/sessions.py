"""Streaming-input sessions over a WebSocket: `/v1/sessions`.

Protocol (JSON text messages):
  client -> server  {"type": "input", "prompt": "text" | [token ids], "max_tokens": 16, ...}
                    (any sampling field of /v1/completions except n, stop and stream; the
                    first chunk's prompt may not be empty, a later one may: generate more)
                    {"type": "end"}  finish the session after the chunks sent so far
  server -> client  {"type": "session.created", "id", "model"}
                    {"type": "delta", "chunk": i, "text", "token_ids"[, "logprobs"]}
                    {"type": "chunk.done", "chunk": i, "finish_reason", "stop_reason", "usage"}
                    {"type": "session.done", "usage", "reason", "message"}  then the socket
                        closes (1000); reason: "end" (the client's), "idle_timeout" (no input
                        for the idle timeout), "length" (the session outgrew the context)
                    {"type": "error", "error": {...}, "fatal": bool}  a refused message (the
                        session goes on) or, fatal, a failed session (the socket closes, 1011,
                        the close reason `code: message` cut to 123 bytes), e.g. a grammar the
                        engine refused for its masks' cost (grammar_too_expensive);
                        a chunk the engine refused as too long for the session names it
                        ("chunk": i; the session goes on, the next chunk is i + 1)
Each chunk is validated (and tokenized, off the event loop) here, once: what the processor made
of it is what the engine runs. Whether it fits the session's context the engine decides.
A binary frame, any message after "end", and a chunk while 64 wait already are refused with an
error message. A message over
the server's size limit closes the socket with 1009 (uvicorn's ws_max_size). A dropped
connection cancels the session's generator, which aborts the session in the engine and frees
its blocks and slot; it is logged once, at debug level.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from slotserve.engine.llm_engine import check_session_chunk
from slotserve.entrypoints.async_llm import StreamingInput
from slotserve.entrypoints.openai.admission import Ticket, client_key, tag_client
from slotserve.entrypoints.openai.errors import APIError, bad_request, from_exception
from slotserve.entrypoints.openai.protocol import SessionChunk, random_uuid
from slotserve.entrypoints.openai.serving_engine import OpenAIServing, to_api_error
from slotserve.entrypoints.openai.structured import (
    check_constraint,
    rename_param,
    response_constraint,
)
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutputKind
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Chunks accepted but not yet applied; past it a chunk is refused (too_many_chunks).
MAX_QUEUED_CHUNKS = 64
# A refused message's error reply must be taken within this (else the client is dropped).
ERROR_SEND_TIMEOUT_S = 2.0
# Sending to or receiving from a client that has gone raises one of these (Starlette's, or
# the ASGI server's after the socket closed); _send and _receive turn them into _Gone.
_SOCKET_ERRORS = (WebSocketDisconnect, RuntimeError, OSError)


class _Gone(Exception):  # noqa: N818 - a condition
    """The client has gone: nothing more can be sent to it."""


async def _send(ws: WebSocket, message: dict[str, Any], timeout: float | None = None) -> None:
    """Send, or raise _Gone: the client has gone, or (with a timeout) has not read its
    messages for that long while sending more (a client flooding a session without reading
    its replies would otherwise block the reader, which could then never see it leave)."""
    try:
        if timeout is None:  # every streamed delta: no timer to arm and cancel
            await ws.send_json(message)
        else:
            async with asyncio.timeout(timeout):
                await ws.send_json(message)
    except (*_SOCKET_ERRORS, TimeoutError) as exc:
        raise _Gone() from exc


@dataclass(slots=True)
class _Queued:
    """A validated chunk and its admission ticket (None without admission control)."""

    chunk: StreamingInput
    ticket: Ticket | None


class _SessionState:
    __slots__ = ("session_id", "chunk_prompt_lens", "total_prompt", "total_completion",
                 "ended", "gone", "client", "tickets", "structured_outputs")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        # The prompt length of each chunk accepted so far (their count: the chunks).
        self.chunk_prompt_lens: list[int] = []
        self.total_prompt = 0
        self.total_completion = 0
        # The client sent "end": anything after it is refused.
        self.ended = False
        # The client went away (seen by the reader or by a failed send).
        self.gone = False
        # Admission control: who the session is for, and each chunk's ticket, in order.
        self.client = ""
        self.tickets: list[Ticket] = []
        # The first chunk's constraint: it spans the session (a later chunk may not change it).
        self.structured_outputs: StructuredOutputsParams | None = None


class OpenAIServingSessions(OpenAIServing):
    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        session_id = f"sess-{random_uuid()}"
        state = _SessionState(session_id)
        state.client = client_key(None, ws.client.host if ws.client is not None else None)
        inputs: asyncio.Queue[_Queued | None] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        try:
            await _send(ws, {"type": "session.created", "id": session_id,
                             "model": self.served_model_names[0]})
        except _Gone:
            return
        writer = asyncio.ensure_future(self._write(ws, session_id, state, inputs))
        reader = asyncio.ensure_future(self._read(ws, state, inputs))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                outcome = reader.result()
                if outcome == "gone":
                    # The client went away: cancelling the writer aborts the session.
                    state.gone = True
                    writer.cancel()
                elif outcome == "idle":
                    writer.cancel()
                    await self._finish(ws, session_id, state, "idle_timeout",
                                       "no input arrived within the idle timeout")
            with contextlib.suppress(asyncio.CancelledError, _Gone):
                await writer
        finally:
            reader.cancel()
            writer.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            if self.admission is not None:
                for ticket in state.tickets:
                    self.admission.finished(ticket)
            if state.gone:
                logger.debug("session %s: the client went away", session_id)

    def _idle_timeout(self) -> float:
        return self.engine.engine.config.scheduler_config.streaming_session_timeout_s

    async def _read(self, ws: WebSocket, state: _SessionState,
                    inputs: asyncio.Queue[_Queued | None]) -> str:
        """Validate client messages into chunks until the client goes ("gone"), or until the
        idle timeout passes before a first chunk ("idle"; later the engine times the session
        out itself)."""
        while True:
            try:
                first_wait = None if state.chunk_prompt_lens else self._idle_timeout()
                async with asyncio.timeout(first_wait):
                    message = await ws.receive()
            except TimeoutError:
                return "idle"
            except _SOCKET_ERRORS:
                return "gone"
            if message["type"] == "websocket.disconnect":
                return "gone"
            text = message.get("text")
            try:
                if text is None:
                    raise bad_request("binary frames are not accepted: send JSON text messages",
                                      None, "unsupported_frame")
                if state.ended:
                    raise bad_request("the session has ended: no input is taken after 'end'",
                                      None, "session_ended")
                parsed = await self._parse(text, state)
                queued = None if parsed is None else self._admit(state, *parsed)
                if queued is not None and inputs.full():
                    # Refused rather than waited for: the reader keeps draining the socket,
                    # so a client that floods and leaves is noticed at once.
                    if queued.ticket is not None and self.admission is not None:
                        self.admission.finished(queued.ticket)
                    raise bad_request(f"{MAX_QUEUED_CHUNKS} chunks are waiting already: wait "
                                      "for a chunk.done before sending more", None,
                                      "too_many_chunks")
                if queued is not None:
                    chunk = queued.chunk
                    if not state.chunk_prompt_lens and chunk.sampling_params is not None:
                        state.structured_outputs = chunk.sampling_params.structured_outputs
                    state.chunk_prompt_lens.append(len(chunk.prompt))
                    if queued.ticket is not None:
                        state.tickets.append(queued.ticket)
            except (APIError, ValidationError, RequestValidationError, ValueError) as exc:
                err = from_exception(exc)
                try:
                    await _send(ws, {"type": "error", **err.body(), "fatal": False},
                                ERROR_SEND_TIMEOUT_S)
                except _Gone:
                    return "gone"
                continue
            await inputs.put(queued)
            if queued is None:
                state.ended = True

    def _admit(self, state: _SessionState, chunk: StreamingInput,
               user: str | None) -> _Queued:
        """Each chunk is work like a completion's: it goes through admission control (a 429
        comes back as an error message), counted for the session's client."""
        if self.admission is None:
            return _Queued(chunk, None)
        if not state.chunk_prompt_lens and user:
            state.client = client_key(user, None)
        params = chunk.sampling_params
        tokens = len(chunk.prompt) + ((params.max_tokens if params else None) or 0)
        # (No delayed refusal here, unlike HTTP: the reader must keep draining the socket.)
        return _Queued(chunk, self.admission.admit(state.client, 1, tokens))

    async def _parse(self, raw: str, state: _SessionState
                     ) -> tuple[StreamingInput, str | None] | None:
        """A message read (JSON and fields on the front's threads), its constraint checked on
        the grammar-check threads in the client's turn (as for HTTP requests: a large schema
        holds up no tokenization), then tokenized and processed on the front's threads.
        With the chunk: its `user`."""
        read = await self.engine.run_off_loop(self._read_chunk, raw)
        if read is None:
            return None
        msg, params = read
        if params.structured_outputs is not None:
            await check_constraint(params.structured_outputs, msg.response_format,
                                   _chunk_client(msg, state))
        return await self.engine.run_off_loop(self._process, msg, params, state)

    def _read_chunk(self, raw: str) -> tuple[SessionChunk, SamplingParams] | None:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise bad_request(f"invalid JSON message: {exc}", None, "invalid_json") from exc
        if not isinstance(data, dict):
            raise bad_request("a message must be a JSON object", None)
        kind = data.get("type", "input")
        if kind == "end":
            return None
        if kind != "input":
            raise bad_request(f"unknown message type {kind!r} (expected 'input' or 'end')",
                              "type")
        msg = SessionChunk.model_validate(data)
        self.check_model(msg.model)
        if msg.n != 1:
            raise bad_request("sessions support only n=1", "n")
        params = msg.to_sampling_params(msg.max_tokens)
        constraint = response_constraint(msg.response_format, msg.structured_outputs)
        if constraint is not None:
            params = params.clone(structured_outputs=constraint)
        return msg, params

    def _process(self, msg: SessionChunk, params: SamplingParams, state: _SessionState
                 ) -> tuple[StreamingInput, str | None]:
        first = not state.chunk_prompt_lens
        # One rule for an empty prompt, as for /v1/completions: the first chunk may not be
        # empty (before tokenization: its BOS alone would look like a prompt).
        prompt = self.engine.processor.tokenize_chunk(msg.prompt, first)
        try:
            if not first:  # refused here, as this chunk: the session goes on
                check_session_chunk(state.structured_outputs, params)
            processed = self.engine.processor.process(
                state.session_id, prompt, params, resumable=True,
                output_kind=RequestOutputKind.DELTA, continuation_of=None if first else 0)
        except RequestValidationError as exc:
            raise rename_param(from_exception(exc), msg.response_format) from exc
        # The client's name on the core request, as for HTTP: its grammar compiles take the
        # client's turn and its masks count against the client's budget per step.
        tag_client([processed], _chunk_client(msg, state))
        return StreamingInput(prompt, params, processed), msg.user

    async def _write(self, ws: WebSocket, session_id: str, state: _SessionState,
                     inputs: asyncio.Queue[_Queued | None]) -> None:
        admission = self.admission

        async def chunks() -> AsyncIterator[StreamingInput]:
            while (item := await inputs.get()) is not None:
                if item.ticket is not None and admission is not None:
                    await admission.wait(item.ticket)  # its turn, among every client's work
                yield item.chunk

        def ticket(index: int) -> Ticket | None:
            return state.tickets[index] if index < len(state.tickets) else None

        chunk_tokens = 0
        reason, message = "end", None
        try:
            async for out in self.engine.generate(chunks(), request_id=session_id):
                c = out.outputs[0]
                chunk_tokens += len(c.token_ids)
                current = ticket(out.chunk)
                if current is not None and admission is not None:
                    admission.started(current)
                if c.text or c.token_ids:
                    msg: dict[str, Any] = {"type": "delta", "chunk": out.chunk,
                                           "text": c.text, "token_ids": c.token_ids}
                    if c.logprobs is not None:
                        msg["logprobs"] = [entry.get(t) for t, entry in
                                           zip(c.token_ids, c.logprobs, strict=False)]
                    await _send(ws, msg)
                if out.finished and not state.ended:
                    # The engine ended a session the client had not ended.
                    reason, message = out.session_end or "end", c.finish_message
                if out.chunk_done:
                    if current is not None and admission is not None:
                        admission.finished(current)
                    if c.rejected:  # the session cannot hold it: refused, the session goes on
                        err = bad_request(c.finish_message or "the chunk does not fit",
                                          "prompt")
                        await _send(ws, {"type": "error", **err.body(), "fatal": False,
                                         "chunk": out.chunk}, ERROR_SEND_TIMEOUT_S)
                    else:
                        await _send(ws, self._chunk_done(state, out.chunk, chunk_tokens,
                                                         c.finish_reason or "stop",
                                                         c.stop_reason))
                    chunk_tokens = 0
        except _Gone:
            state.gone = True
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client, then closed
            logger.warning("session %s failed: %s", session_id, type(exc).__name__)
            err = to_api_error(exc)  # a refusal names its constraint's field already
            # The client may be gone already (a failed send is what raised).
            with contextlib.suppress(Exception):
                await ws.send_json({"type": "error", **err.body(), "fatal": True})
                # The reason too, for a client that reads only the close frame (a grammar
                # refused for its masks' cost ends the session here, not as session.done).
                await ws.close(code=1011, reason=close_reason(err))
            return
        await self._finish(ws, session_id, state, reason, message)

    async def _finish(self, ws: WebSocket, session_id: str, state: _SessionState,
                      reason: str, message: str | None) -> None:
        with contextlib.suppress(_Gone, *_SOCKET_ERRORS):
            await _send(ws, {"type": "session.done", "id": session_id, "usage": _usage(
                state.total_prompt, state.total_completion), "reason": reason,
                "message": message})
            await ws.close(code=1000)

    @staticmethod
    def _chunk_done(state: _SessionState, index: int, num_tokens: int, finish_reason: str,
                    stop_reason: int | str | None) -> dict[str, Any]:
        prompt = state.chunk_prompt_lens[index] if index < len(state.chunk_prompt_lens) else 0
        state.total_prompt += prompt
        state.total_completion += num_tokens
        return {"type": "chunk.done", "chunk": index, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "usage": _usage(prompt, num_tokens)}


# A close frame's reason is at most 123 bytes of UTF-8 (RFC 6455: 125 less the code).
MAX_CLOSE_REASON_BYTES = 123


def close_reason(err: APIError) -> str:
    """`code: message`, cut to fit a close frame (on a character boundary)."""
    text = f"{err.code}: {err.message}" if err.code else err.message
    return text.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors="ignore")


def _chunk_client(msg: SessionChunk, state: _SessionState) -> str:
    """Who a chunk is for: the first chunk's `user` names the session's client (_admit)."""
    if msg.user and not state.chunk_prompt_lens:
        return client_key(msg.user, None)
    return state.client


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return OpenAIServing.usage(prompt_tokens, completion_tokens, 0).model_dump(
        exclude={"prompt_tokens_details"})
