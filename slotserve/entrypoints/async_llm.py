"""AsyncLLM: the engine behind an asyncio API, stepping on a thread of its own.

The LLMEngine is not thread-safe, so exactly one thread (the engine loop) ever calls it. The
asyncio side talks to that thread only through a thread-safe command queue, and the loop hands
each step's outputs back with one `call_soon_threadsafe` per step. The loop blocks only while
the engine is idle, so a busy engine steps back to back and never waits for the HTTP side.

Outputs are DELTA outputs: each RequestOutput carries only the text, tokens and logprobs that
are new since the previous one the caller received. When the caller falls behind, pending
deltas are merged into one, never across a streaming session's chunk boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.processor import ProcessedRequest, Processor
from slotserve.errors import EngineDeadError, RequestValidationError
from slotserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamingInput:
    """One input chunk of a streaming-input session."""

    prompt: str | list[int]
    sampling_params: SamplingParams | None = None


@dataclass(slots=True)
class StepResult:
    """What the engine thread hands to the event loop after a step."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests the engine refused when they were added (validated again in the engine).
    request_errors: list[tuple[str, BaseException]] = field(default_factory=list)
    # Message of a model-step failure in this step; its requests end with "error".
    step_error: str | None = None
    # Set when the engine cannot continue: every open request fails.
    dead_error: BaseException | None = None


_ADD, _ADD_PROCESSED, _ABORT, _CALL, _STOP = range(5)


class EngineLoop:
    """The one thread that calls the engine: applies queued commands, then steps."""

    def __init__(self, engine: Any, post: Callable[[StepResult], None]) -> None:
        self.engine = engine
        self._post = post
        self._cmds: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.dead_error: BaseException | None = None
        # How busy the loop keeps the engine: seconds inside step() and the number of steps.
        self.busy_s = 0.0
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="slotserve-engine-loop",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None, *,
                    priority: int, resumable: bool) -> None:
        self._cmds.put((_ADD, (request_id, prompt, params, priority, resumable)))

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        self._cmds.put((_ADD_PROCESSED, processed))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            self._cmds.put((_ABORT, request_ids))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.dead_error is not None:
            future.set_exception(EngineDeadError(str(self.dead_error)))
        else:
            self._cmds.put((_CALL, (fn, future)))
        return future

    def stop(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._cmds.put((_STOP, None))
            self._thread.join(timeout)

    def _failed_steps(self) -> int:
        core = getattr(self.engine, "engine_core", None)
        return int(getattr(core, "num_failed_steps", 0))

    def _last_step_error(self) -> str:
        exc = getattr(getattr(self.engine, "engine_core", None), "last_error", None)
        return f"{type(exc).__name__}: {exc}" if exc is not None else "model step failed"

    def _apply(self, kind: int, arg: Any, errors: list[tuple[str, BaseException]]) -> bool:
        engine = self.engine
        if kind == _ADD_PROCESSED:
            try:
                engine.add_processed_request(arg)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                errors.append((arg.request_id, exc))
        elif kind == _ADD:
            rid, prompt, params, priority, resumable = arg
            try:
                engine.add_request(rid, prompt, params, priority=priority, resumable=resumable,
                                   output_kind=RequestOutputKind.DELTA)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                errors.append((rid, exc))
        elif kind == _ABORT:
            engine.abort_request(arg)
        elif kind == _CALL:
            fn, future = arg
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
        return kind != _STOP

    def _run(self) -> None:
        engine, cmds = self.engine, self._cmds
        failed_steps = self._failed_steps()
        running = True
        while running:
            errors: list[tuple[str, BaseException]] = []
            # Block only when idle: a busy engine must never wait for the event loop.
            item = cmds.get() if not engine.has_unfinished_requests() else _poll(cmds)
            while item is not None and running:
                running = self._apply(item[0], item[1], errors)
                item = _poll(cmds)
            result = StepResult(request_errors=errors)
            if running and engine.has_unfinished_requests():
                t0 = time.perf_counter()
                try:
                    result.outputs = engine.step()
                except BaseException as exc:  # noqa: BLE001 - the engine cannot continue
                    logger.exception("engine step failed; the engine is dead")
                    self.dead_error = result.dead_error = exc
                    running = False
                self.busy_s += time.perf_counter() - t0
                self.num_steps += 1
                if self._failed_steps() != failed_steps:
                    failed_steps = self._failed_steps()
                    result.step_error = self._last_step_error()
            if result.outputs or result.request_errors or result.dead_error is not None:
                self._post(result)
        self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        error = EngineDeadError(str(self.dead_error or "the engine loop stopped"))
        while (item := _poll(self._cmds)) is not None:
            if item[0] == _CALL and item[1][1].set_running_or_notify_cancel():
                item[1][1].set_exception(error)


def _poll(cmds: queue.SimpleQueue[tuple[int, Any]]) -> tuple[int, Any] | None:
    try:
        return cmds.get_nowait()
    except queue.Empty:
        return None


class RequestFailedError(RuntimeError):
    """The engine ended a request with an error (a failed model step)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the model step: {message}")
        self.request_id = request_id
        self.message = message


class _RequestStream:
    """Outputs of one request waiting for its consumer, on the event loop's side."""

    __slots__ = ("request_id", "items", "event", "error", "boundaries")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items: list[RequestOutput] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        self.boundaries = 0

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get_all(self) -> list[RequestOutput]:
        while not self.items:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        items, self.items = self.items, []
        return items


def _is_boundary(out: RequestOutput) -> bool:
    return not out.finished and bool(out.outputs) and out.outputs[0].finish_reason is not None


def merge_deltas(items: list[RequestOutput]) -> list[RequestOutput]:
    """Collapse consecutive delta outputs; a chunk boundary ends a group."""
    merged: list[RequestOutput] = []
    start = 0
    for i, out in enumerate(items):
        if _is_boundary(out) or out.finished or i == len(items) - 1:
            merged.append(_merge_run(items[start:i + 1]))
            start = i + 1
    return merged


def _merge_run(run: list[RequestOutput]) -> RequestOutput:
    if len(run) == 1:
        return run[0]
    last = run[-1]
    by_index: dict[int, CompletionOutput] = {}
    for out in run:
        for c in out.outputs:
            prev = by_index.get(c.index)
            if prev is None:
                by_index[c.index] = CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                    None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                    c.stop_reason)
                continue
            prev.text += c.text
            prev.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
            prev.cumulative_logprob = c.cumulative_logprob
            prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [by_index[i] for i in sorted(by_index)], last.finished,
                         last.num_cached_tokens, last.metrics)


class AsyncLLM:
    """Async front of an LLMEngine. Build with `AsyncLLM.from_engine_args(model=PATH, ...)`."""

    def __init__(self, engine: Any, *, metrics: Any = None) -> None:
        self.engine = engine
        self.metrics = metrics
        # The engine thread decodes with the engine's tokenizer; the event loop tokenizes
        # prompts with its own copy so the two never share the Rust object's borrow state.
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is still usable
            self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.model_config = getattr(engine, "model_config", None)
        # Validation and tokenization happen here, on the event loop, so a bad request is
        # refused before the engine thread ever sees it.
        self.processor: Processor = copy.copy(engine.processor)
        self.processor.tokenizer = self.tokenizer
        self._streams: dict[str, _RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._engine_loop = EngineLoop(engine, self._post_from_engine)
        self._engine_loop.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, metrics: Any = None,
                         **engine_args: Any) -> AsyncLLM:
        from slotserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(model=model, **engine_args), metrics=metrics)

    # ----- health -----------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._engine_loop.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._engine_loop.dead_error

    def check_health(self) -> None:
        if self._engine_loop.dead_error is not None:
            raise EngineDeadError(str(self._engine_loop.dead_error))

    # ----- inputs -----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def process_request(self, prompt: str | list[int] | dict[str, Any],
                        sampling_params: SamplingParams | None = None,
                        request_id: str | None = None, *, priority: int = 0) -> ProcessedRequest:
        """Validate and tokenize a request (raises RequestValidationError, touches nothing)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestValidationError(f"request id {request_id!r} is already running",
                                         "request_id")
        return self.processor.process(request_id, prompt, sampling_params,
                                      priority=priority, output_kind=RequestOutputKind.DELTA)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        return loop

    def _register(self, request_id: str | None) -> _RequestStream:
        self._bind_loop()
        self.check_health()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestValidationError(f"request id {request_id!r} is already running",
                                         "request_id")
        stream = _RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    async def generate(
        self,
        prompt: (str | list[int] | dict[str, Any] | ProcessedRequest
                 | AsyncIterable[StreamingInput]),
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta RequestOutputs of one request, or of a streaming-input session when
        `prompt` is an async iterable of StreamingInput chunks. A `prompt` already checked
        by `process_request` is submitted as it is.

        Leaving the iteration early (break, cancellation, a dropped client) aborts the
        request in the engine, which frees its KV blocks and its worker slot.
        """
        if isinstance(prompt, AsyncIterable):
            async for out in self._generate_session(prompt, sampling_params, request_id,
                                                    priority):
                yield out
            return
        processed = prompt if isinstance(prompt, ProcessedRequest) else self.process_request(
            prompt, sampling_params, request_id, priority=priority)
        stream = self._register(processed.request_id)
        rid = stream.request_id
        finished = False
        try:
            self._engine_loop.add_processed_request(processed)
            while not finished:
                for out in merge_deltas(await stream.get_all()):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._engine_loop.abort([rid])

    async def _generate_session(self, inputs: AsyncIterable[StreamingInput],
                                default_params: SamplingParams | None, request_id: str | None,
                                priority: int) -> AsyncIterator[RequestOutput]:
        stream = self._register(request_id)
        rid = stream.request_id
        state = {"sent": 0, "done": False}

        async def feed() -> None:
            try:
                async for chunk in inputs:
                    params = chunk.sampling_params or default_params
                    first = state["sent"] == 0
                    prompt = chunk.prompt
                    if isinstance(prompt, str):
                        # Only the session's first chunk starts with BOS and friends.
                        prompt = self.tokenize(prompt, add_special_tokens=first)
                    self._engine_loop.add_request(rid, {"prompt_token_ids": list(prompt)},
                                                  params, priority=priority, resumable=True)
                    state["sent"] += 1
                if state["sent"]:
                    # A non-resumable request with the session's id ends the session once
                    # its last chunk stops.
                    self._engine_loop.add_request(rid, {"prompt_token_ids": []},
                                                  default_params, priority=priority,
                                                  resumable=False)
                state["done"] = True
                stream.event.set()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                stream.fail(exc)

        feeder = asyncio.get_running_loop().create_task(feed(), name=f"session-feed-{rid}")
        finished = False
        try:
            while not finished:
                while not stream.items:
                    if stream.error is not None:
                        raise stream.error
                    if state["done"] and stream.boundaries >= state["sent"]:
                        # The last chunk already stopped: the end mark finishes it in the
                        # engine; the caller has everything.
                        finished = True
                        break
                    stream.event.clear()
                    await stream.event.wait()
                if finished:
                    break
                items, stream.items = stream.items, []
                for out in merge_deltas(items):
                    if _is_boundary(out):
                        stream.boundaries += 1
                    finished = out.finished
                    yield out
                    if finished:
                        break
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            self._streams.pop(rid, None)
            if not finished or not state["done"]:
                self._engine_loop.abort([rid])

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.fail(asyncio.CancelledError(f"request {rid} aborted"))
        self._engine_loop.abort(ids)

    # ----- engine calls -----------------------------------------------------------------------

    async def call_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        self._bind_loop()
        return await asyncio.wrap_future(self._engine_loop.call(fn))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.call_in_engine(
            lambda e: e.reset_prefix_cache(reset_running_requests=reset_running_requests)))

    async def get_stats(self) -> Any:
        return await self.call_in_engine(lambda e: e.get_stats())

    def shutdown(self, timeout: float = 10.0) -> None:
        self._engine_loop.stop(timeout)

    # ----- outputs from the engine thread -----------------------------------------------------

    def _post_from_engine(self, result: StepResult) -> None:
        # Called on the engine thread: hand over to the event loop, once per step.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._dispatch, result)

    def _dispatch(self, result: StepResult) -> None:
        metrics = self.metrics
        for rid, error in result.request_errors:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.fail(error)
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                if metrics is not None:
                    _record_finished(metrics, out)
                if stream is not None:
                    del self._streams[out.request_id]
                if any(c.finish_reason == "error" for c in out.outputs):
                    logger.error("request %s failed in the model step: %s", out.request_id,
                                 result.step_error or "unknown error")
                    if stream is not None:
                        stream.fail(RequestFailedError(out.request_id,
                                                       result.step_error or "model step failed"))
                        continue
            if stream is not None:
                stream.put(out)
        if result.dead_error is not None:
            error = EngineDeadError(str(result.dead_error))
            for stream in self._streams.values():
                stream.fail(error)
            self._streams.clear()


def _record_finished(metrics: Any, out: RequestOutput) -> None:
    m = out.metrics
    reason = out.outputs[0].finish_reason if out.outputs else None
    metrics.observe_finished(m, reason)
    if m is None:
        return
    metrics.observe_first_token(m.arrival_time, m.first_token_time)
    times = m.token_times
    for a, b in itertools.pairwise(times):
        metrics.observe_itl(b - a)


__all__ = ["AsyncLLM", "RequestFailedError", "RequestOutputKind", "StreamingInput",
           "merge_deltas"]
