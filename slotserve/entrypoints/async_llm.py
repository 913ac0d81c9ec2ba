"""AsyncLLM: the engine behind an asyncio API, stepping off the event loop.

The LLMEngine is not thread-safe, so exactly one thread (the engine loop, engine_loop.py)
ever calls it, on a thread of this process or in a child process. The asyncio side talks to it
only through a command queue, and each step's outputs come back with one
`call_soon_threadsafe` per step. Requests are validated and tokenized here, on the event loop,
before anything is sent.

Outputs are DELTA outputs: each RequestOutput carries only the text, tokens and logprobs that
are new since the previous one the caller received. When the caller falls behind, pending
deltas are merged into one, never across a streaming session's chunk boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from slotserve.engine.processor import ProcessedRequest, Processor
from slotserve.entrypoints.engine_loop import (
    LoopStats,
    ProcessEngineClient,
    StepResult,
    ThreadEngineClient,
)
from slotserve.errors import EngineDeadError, RequestValidationError
from slotserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamingInput:
    """One input chunk of a streaming-input session."""

    prompt: str | list[int]
    sampling_params: SamplingParams | None = None


class RequestFailedError(RuntimeError):
    """The engine ended a request with an error (a failed model step)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the model step: {message}")
        self.request_id = request_id
        self.message = message


class _RequestStream:
    """Outputs of one request waiting for its consumer, on the event loop's side."""

    __slots__ = ("request_id", "num_seqs", "items", "event", "error", "boundaries", "prompts",
                 "dispatched_chunks")

    def __init__(self, request_id: str, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.items: list[RequestOutput] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        self.boundaries = 0
        # What was sent, per chunk: a process-mode engine does not send prompts back.
        self.prompts: list[tuple[str | None, list[int]]] = []
        self.dispatched_chunks = 0

    def fill_prompt(self, out: RequestOutput) -> None:
        if out.prompt_token_ids is None and self.prompts:
            chunk = min(self.dispatched_chunks, len(self.prompts) - 1)
            out.prompt, out.prompt_token_ids = self.prompts[chunk]
        if _is_boundary(out):
            self.dispatched_chunks += 1

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
                by_index[c.index] = dataclasses.replace(
                    c, token_ids=list(c.token_ids),
                    logprobs=None if c.logprobs is None else list(c.logprobs))
                continue
            prev.text += c.text
            prev.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
            prev.cumulative_logprob = c.cumulative_logprob
            prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
            prev.finish_message = c.finish_message
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [by_index[i] for i in sorted(by_index)], last.finished,
                         last.num_cached_tokens, last.metrics)


class AsyncLLM:
    """Async front of an LLMEngine. Build with `AsyncLLM.from_engine_args(model=PATH, ...)`."""

    def __init__(self, engine: Any = None, *, metrics: Any = None,
                 _client: Any = None, _tokenizer: Any = None) -> None:
        """Serve an LLMEngine built by the caller, on a thread (see from_engine_args for the
        process mode)."""
        self.metrics = metrics
        self._streams: dict[str, _RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        # In thread mode the engine object is here (tests reach into it through
        # call_in_engine); in process mode it lives in the child.
        self.engine = engine
        if _client is None:
            _tokenizer = engine.tokenizer
            _client = ThreadEngineClient(engine, self._post_from_engine)
        self._client: ThreadEngineClient | ProcessEngineClient = _client
        info = _client.info
        # The engine decodes with its tokenizer on its own thread; the event loop tokenizes
        # with a copy, so the two never share the Rust object's borrow state.
        try:
            self.tokenizer = copy.deepcopy(_tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied still works
            self.tokenizer = _tokenizer
        self.max_model_len: int = info.max_model_len
        self.processor = Processor(self.tokenizer, info.max_model_len, info.vocab_size,
                                   info.eos_token_ids)

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, metrics: Any = None,
                         engine_mode: Literal["thread", "process"] = "thread",
                         threads: int | None = None, **engine_args: Any) -> AsyncLLM:
        """Build the engine on a thread of this process, or (engine_mode="process") in a
        spawned child process so the step loop never shares a GIL with the event loop (the
        calling script then needs the usual `if __name__ == "__main__":` guard; `threads`
        sets the child's torch threads)."""
        if engine_mode == "thread":
            from slotserve.engine.llm_engine import LLMEngine

            return cls(LLMEngine.from_engine_args(model=model, **engine_args), metrics=metrics)
        if engine_mode != "process":
            raise RequestValidationError(f"unknown engine_mode {engine_mode!r}", "engine_mode")
        from slotserve.engine.args import EngineArgs
        from slotserve.engine.llm_engine import load_tokenizer

        args = EngineArgs.from_kwargs(model=model, **engine_args)
        path = args.tokenizer or args.model_path()
        self = cls.__new__(cls)
        # The tokenizer loads here while the child starts the engine (seconds each for a large
        # vocabulary). The child loads it too, so a broken one fails the child the same way.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, path)
            client = ProcessEngineClient(dict(model=model, **engine_args),
                                         lambda result: self._post_from_engine(result),
                                         threads=threads)
        cls.__init__(self, None, metrics=metrics, _client=client,
                     _tokenizer=tokenizer.result())
        return self

    # ----- health -----------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._client.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._client.dead_error

    def check_health(self) -> None:
        if self._client.dead_error is not None:
            raise EngineDeadError(str(self._client.dead_error))

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

    def _register(self, request_id: str | None, num_seqs: int = 1) -> _RequestStream:
        self._bind_loop()
        self.check_health()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise RequestValidationError(f"request id {request_id!r} is already running",
                                         "request_id")
        stream = _RequestStream(request_id, num_seqs)
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
        stream = self._register(processed.request_id, len(processed.requests))
        stream.prompts.append((processed.prompt, processed.prompt_token_ids))
        rid = stream.request_id
        finished = False
        try:
            self._client.add_processed_request(processed)
            while not finished:
                for out in merge_deltas(await stream.get_all()):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._client.abort([rid])

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
                    stream.prompts.append((None, list(prompt)))
                    self._client.add_request(rid, {"prompt_token_ids": stream.prompts[-1][1]},
                                             params, priority=priority, resumable=True)
                    state["sent"] += 1
                if state["sent"]:
                    # A non-resumable request with the session's id ends the session once
                    # its last chunk stops.
                    self._client.add_request(rid, {"prompt_token_ids": []}, default_params,
                                             priority=priority, resumable=False)
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
                    if finished and stream.boundaries >= state["sent"] and not any(
                            c.token_ids for c in out.outputs):
                        # The session ended while paused (its end mark, or an idle
                        # timeout): the last chunk's finish was already delivered.
                        break
                    yield out
                    if finished:
                        break
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            self._streams.pop(rid, None)
            if not finished or not state["done"]:
                self._client.abort([rid])

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                # The caller's loop ends with an "abort" finish, as if the engine said so.
                stream.put(RequestOutput(rid, None, [], [
                    CompletionOutput(i, "", [], None, None, "abort")
                    for i in range(stream.num_seqs)], finished=True))
        self._client.abort(ids)

    # ----- engine calls -----------------------------------------------------------------------

    async def call_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result.
        In process mode `fn` must pickle (a module-level function or a partial of one)."""
        self._bind_loop()
        return await asyncio.wrap_future(self._client.call(fn))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.call_in_engine(functools.partial(
            _reset_prefix_cache, reset_running_requests=reset_running_requests)))

    async def get_stats(self) -> Any:
        return await self.call_in_engine(_get_stats)

    async def loop_stats(self) -> LoopStats:
        """How busy the front keeps the engine's step loop (time in step() over wall time)."""
        self._bind_loop()
        return await asyncio.wrap_future(self._client.loop_stats())

    def shutdown(self, timeout: float = 10.0) -> None:
        self._client.stop(timeout)

    # ----- outputs from the engine thread -----------------------------------------------------

    def _post_from_engine(self, result: StepResult) -> None:
        # Called on the engine (or pipe reader) thread: hand over to the event loop, once per
        # step. Before the first request there is no loop yet, and nothing to deliver.
        loop = getattr(self, "_loop", None)
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
            if stream is not None:
                stream.fill_prompt(out)
            if out.finished:
                if metrics is not None:
                    _record_finished(metrics, out)
                if stream is not None:
                    del self._streams[out.request_id]
                failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
                if failed is not None:
                    message = (failed.finish_message or result.step_error
                               or "model step failed")
                    logger.error("request %s failed in the model step: %s", out.request_id,
                                 message)
                    if stream is not None:
                        stream.fail(RequestFailedError(out.request_id, message))
                        continue
            if stream is not None:
                stream.put(out)
        if result.dead_error is not None:
            error = EngineDeadError(str(result.dead_error))
            for stream in self._streams.values():
                stream.fail(error)
            self._streams.clear()


def _reset_prefix_cache(engine: Any, reset_running_requests: bool) -> bool:
    return bool(engine.reset_prefix_cache(reset_running_requests=reset_running_requests))


def _get_stats(engine: Any) -> Any:
    return engine.get_stats()


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
