"""Streaming-input sessions over a WebSocket: `/v1/sessions`.

Protocol (JSON text messages):
  client -> server  {"type": "input", "prompt": "text" | [token ids], "max_tokens": 16, ...}
                    (any sampling field of /v1/completions except n, stop and stream)
                    {"type": "end"}  finish the session after the chunks sent so far
  server -> client  {"type": "session.created", "id", "model"}
                    {"type": "delta", "chunk": i, "text", "token_ids"[, "logprobs"]}
                    {"type": "chunk.done", "chunk": i, "finish_reason", "stop_reason", "usage"}
                    {"type": "session.done", "usage"}            then the socket closes (1000)
                    {"type": "error", "error": {...}}            a refused message; the session
                                                                 goes on, unless "fatal" is true
Each chunk is validated here before it reaches the engine. A dropped connection cancels the
session's generator, which aborts the session in the engine and frees its blocks and slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from slotserve.core.sessions import kept_output_tokens
from slotserve.entrypoints.async_llm import StreamingInput
from slotserve.entrypoints.openai.errors import APIError, bad_request, from_exception
from slotserve.entrypoints.openai.protocol import SessionChunk, random_uuid
from slotserve.entrypoints.openai.serving_engine import OpenAIServing, to_api_error

logger = logging.getLogger(__name__)

# Chunks accepted but not yet applied; a client far ahead of the engine waits for room.
MAX_QUEUED_CHUNKS = 64


class _SessionState:
    __slots__ = ("num_chunks", "held_tokens", "chunk_prompt_lens", "total_prompt",
                 "total_completion")

    def __init__(self) -> None:
        self.num_chunks = 0
        # Tokens the session holds in the engine as far as finished chunks tell (the fold rule
        # of slotserve.core.sessions; an in-flight chunk's outputs are unknown, and the
        # engine checks again exactly).
        self.held_tokens = 0
        self.chunk_prompt_lens: list[int] = []
        self.total_prompt = 0
        self.total_completion = 0


class OpenAIServingSessions(OpenAIServing):
    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        session_id = f"sess-{random_uuid()}"
        state = _SessionState()
        inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        await ws.send_json({"type": "session.created", "id": session_id,
                            "model": self.served_model_names[0]})
        writer = asyncio.ensure_future(self._write(ws, session_id, state, inputs))
        reader = asyncio.ensure_future(self._read(ws, state, inputs))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done and reader.result() is False:
                # The client went away: cancelling the writer aborts the session.
                writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect):
                await writer
        finally:
            reader.cancel()
            writer.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)

    async def _read(self, ws: WebSocket, state: _SessionState,
                    inputs: asyncio.Queue[StreamingInput | None]) -> bool:
        """Validate client messages into chunks; False when the client disconnected."""
        try:
            while True:
                raw = await ws.receive_text()
                try:
                    chunk = self._parse(raw, state)
                except (APIError, ValidationError, ValueError) as exc:
                    err = from_exception(exc)
                    await ws.send_json({"type": "error", **err.body(), "fatal": False})
                    continue
                await inputs.put(chunk)
                if chunk is None:
                    return True
        except WebSocketDisconnect:
            return False

    def _parse(self, raw: str, state: _SessionState) -> StreamingInput | None:
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
        first = state.num_chunks == 0
        prompt = self.engine.processor.tokenize_chunk(msg.prompt, first)
        if first and not prompt:
            raise bad_request("the first chunk's prompt is empty", "prompt")
        self.engine.processor.process(
            "session-check", prompt, params, resumable=True,
            continuation_of=None if first else state.held_tokens)
        state.num_chunks += 1
        state.held_tokens += len(prompt)
        state.chunk_prompt_lens.append(len(prompt))
        return StreamingInput(prompt=prompt, sampling_params=params)

    async def _write(self, ws: WebSocket, session_id: str, state: _SessionState,
                     inputs: asyncio.Queue[StreamingInput | None]) -> None:
        async def chunks() -> AsyncIterator[StreamingInput]:
            while (item := await inputs.get()) is not None:
                yield item

        chunk_index = 0
        chunk_tokens = 0
        try:
            async for out in self.engine.generate(chunks(), request_id=session_id):
                c = out.outputs[0]
                chunk_tokens += len(c.token_ids)
                if c.text or c.token_ids:
                    msg: dict[str, Any] = {"type": "delta", "chunk": chunk_index,
                                           "text": c.text, "token_ids": c.token_ids}
                    if c.logprobs is not None:
                        msg["logprobs"] = [entry.get(t) for t, entry in
                                           zip(c.token_ids, c.logprobs, strict=False)]
                    await ws.send_json(msg)
                if c.finish_reason is not None:
                    await ws.send_json(self._chunk_done(state, chunk_index, chunk_tokens,
                                                        c.finish_reason, c.stop_reason))
                    state.held_tokens += kept_output_tokens(chunk_tokens)
                    chunk_index += 1
                    chunk_tokens = 0
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client, then closed
            logger.warning("session %s failed: %s", session_id, exc)
            err = to_api_error(exc)
            # The client may be gone already (a failed send is what raised).
            with contextlib.suppress(Exception):
                await ws.send_json({"type": "error", **err.body(), "fatal": True})
                await ws.close(code=1011)
            return
        await ws.send_json({"type": "session.done", "id": session_id, "usage": _usage(
            state.total_prompt, state.total_completion)})
        await ws.close(code=1000)

    @staticmethod
    def _chunk_done(state: _SessionState, index: int, num_tokens: int, finish_reason: str,
                    stop_reason: int | str | None) -> dict[str, Any]:
        prompt = state.chunk_prompt_lens[index] if index < len(state.chunk_prompt_lens) else 0
        state.total_prompt += prompt
        state.total_completion += num_tokens
        return {"type": "chunk.done", "chunk": index, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "usage": _usage(prompt, num_tokens)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return OpenAIServing.usage(prompt_tokens, completion_tokens, 0).model_dump(
        exclude={"prompt_tokens_details"})
