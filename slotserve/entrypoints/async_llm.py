"""AsyncLLM: the engine behind an asyncio API, its core stepping off the event loop.

It drives an LLMEngine (the front: validation, tokenization, detokenization) on the event
loop, over a core that steps on its own thread or in a child process (engine/core_client.py).
One task on the loop takes each batch of core outputs as it comes, turns it into
RequestOutputs and hands them to the requests' streams.

Outputs are DELTA outputs: each RequestOutput carries only the text, tokens and logprobs that
are new since the previous one the caller received. When the caller falls behind, pending
deltas are merged into one, never across a streaming session's chunk boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from slotserve.core.outputs import FinishReason
from slotserve.engine.args import EngineArgs
from slotserve.engine.core_client import InprocClient
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.messages import EngineStats
from slotserve.engine.processor import ProcessedRequest, Processor, PromptType
from slotserve.errors import ConfigError, EngineDeadError, RequestValidationError
from slotserve.lora.request import LoRARequest
from slotserve.metrics import ServerMetrics
from slotserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamingInput:
    """One input chunk of a streaming-input session. A caller that validated it already
    (the WebSocket handler, to refuse it as that message) passes what Processor.process made
    of it, and it is submitted as it is."""

    prompt: str | list[int]
    sampling_params: SamplingParams | None = None
    processed: ProcessedRequest | None = None


class RequestFailedError(RuntimeError):
    """The engine ended a request with an error (a failed model step)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the model step: {message}")
        self.request_id = request_id
        self.message = message


class _RequestStream:
    """Outputs of one request waiting for its consumer, on the event loop's side."""

    __slots__ = ("request_id", "num_seqs", "items", "event", "error", "closed")

    def __init__(self, request_id: str, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.items: list[RequestOutput] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        # No more outputs will come (a session whose input ended before any chunk).
        self.closed = False

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


def _ends_run(out: RequestOutput) -> bool:
    """Deltas are merged up to an output that carries a finish (a chunk's or the request's)."""
    return (out.finished or out.chunk_done
            or (bool(out.outputs) and out.outputs[0].finish_reason is not None))


def merge_deltas(items: list[RequestOutput]) -> list[RequestOutput]:
    """Collapse consecutive delta outputs; a chunk's end ends a group."""
    merged: list[RequestOutput] = []
    start = 0
    for i, out in enumerate(items):
        if _ends_run(out) or i == len(items) - 1:
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
            prev.finish_message, prev.rejected = c.finish_message, c.rejected
            prev.error_code, prev.error_param = c.error_code, c.error_param
    return dataclasses.replace(last, outputs=[by_index[i] for i in sorted(by_index)])


async def _run_in(pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., T],
                  *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on one of the front's thread pools, awaited from the loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))


class AsyncLLM:
    """Async front of an LLMEngine whose core steps in the background. Build with
    `AsyncLLM.from_engine_args(model=PATH, engine_mode="thread" | "process", ...)`."""

    def __init__(self, engine: LLMEngine, *, metrics: ServerMetrics | None = None) -> None:
        if isinstance(engine.engine_core, InprocClient):
            raise ConfigError("AsyncLLM needs a core that steps on its own: engine mode "
                              "'thread' or 'process'")
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.processor: Processor = engine.processor
        self.max_model_len = engine.max_model_len
        self._streams: dict[str, _RequestStream] = {}
        # Tokenization and chat templating run here, off the event loop (the Rust tokenizer
        # releases the GIL in Processor.tokenize); two threads, so one long prompt does not
        # hold up every other request's.
        self._front_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="slotserve-front")
        # Chat requests render their template (in a child process, which a first render
        # starts: about a second) and then tokenize on threads of their own: with them on the
        # two above, two chat requests at once held every plain completion for that second.
        self._chat_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="slotserve-chat")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_handler: asyncio.Task[None] | None = None
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, metrics: ServerMetrics | None = None,
                         engine_mode: Literal["thread", "process"] = "thread",
                         threads: int | None = None, **engine_args: Any) -> AsyncLLM:
        """The core on a thread of this process, or (engine_mode="process") in a spawned
        child process so the step loop never shares a GIL with the event loop (the calling
        script then needs the usual `if __name__ == "__main__":` guard; `threads` sets the
        child's torch threads)."""
        if engine_mode not in ("thread", "process"):
            raise ConfigError(f"unknown engine_mode {engine_mode!r}; use thread or process")
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        return cls(LLMEngine.from_engine_args(args, mode=engine_mode, threads=threads),
                   metrics=metrics)

    # ----- health -----------------------------------------------------------------------------

    @property
    def dead_error(self) -> BaseException | None:
        return self.engine.engine_core.dead_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    # ----- inputs -----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize(text, add_special_tokens=add_special_tokens)

    async def run_off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the front's worker threads (tokenization, chat templates),
        so the event loop keeps answering meanwhile."""
        return await _run_in(self._front_pool, fn, *args, **kwargs)

    async def run_chat_off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """As run_off_loop, on the chat threads (a chat template's render, then its
        tokenization), so a render never holds up a plain request's tokenization."""
        return await _run_in(self._chat_pool, fn, *args, **kwargs)

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def process_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                        request_id: str | None = None, *, priority: int = 0,
                        lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and tokenize a request (raises RequestValidationError, touches nothing;
        a request id already running is refused when it is submitted)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        return self.engine.process_request(request_id, prompt, sampling_params,
                                           priority=priority,
                                           output_kind=RequestOutputKind.DELTA,
                                           lora_request=lora_request)

    def _register(self, request_id: str | None, num_seqs: int = 1) -> _RequestStream:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        self.check_health()
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = loop.create_task(self._handle_outputs(),
                                                    name="slotserve-output-handler")
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
        prompt: PromptType | ProcessedRequest | AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
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
        rid = stream.request_id
        finished = False
        try:
            self.engine.add_processed_request(processed)
            while not finished:
                for out in merge_deltas(await stream.get_all()):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)

    async def _generate_session(self, inputs: AsyncIterable[StreamingInput],
                                default_params: SamplingParams | None, request_id: str | None,
                                priority: int) -> AsyncIterator[RequestOutput]:
        stream = self._register(request_id)
        rid = stream.request_id

        async def feed() -> None:
            first = True
            try:
                async for chunk in inputs:
                    if chunk.processed is not None:
                        self.engine.add_processed_request(chunk.processed)
                    else:
                        prompt = chunk.prompt
                        if isinstance(prompt, str) or first:
                            prompt = await self.run_off_loop(self.processor.tokenize_chunk,
                                                             prompt, first)
                        self.engine.add_request(rid, {"prompt_token_ids": prompt},
                                                chunk.sampling_params or default_params,
                                                priority=priority, resumable=True,
                                                output_kind=RequestOutputKind.DELTA)
                    first = False
                if first:
                    stream.closed = True  # no chunk came: there is no session to end
                    stream.event.set()
                else:
                    # A non-resumable request with the session's id ends the session once
                    # its last chunk stops; the core answers with the session's end.
                    self.engine.add_request(rid, {"prompt_token_ids": []}, default_params,
                                            priority=priority)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                stream.fail(exc)

        feeder = asyncio.get_running_loop().create_task(feed(), name=f"session-feed-{rid}")
        finished = False
        try:
            while not finished:
                while not stream.items and not stream.closed:
                    if stream.error is not None:
                        raise stream.error
                    stream.event.clear()
                    await stream.event.wait()
                if not stream.items:
                    break
                items, stream.items = stream.items, []
                for out in merge_deltas(items):
                    finished = out.finished
                    if out.session_end == FinishReason.END and not out.chunk_done:
                        # Ended between chunks on the caller's end mark: the caller has
                        # everything. (An end it did not ask for, an idle timeout, is
                        # yielded: its finish_message says why.)
                        break
                    yield out
                    if finished:
                        break
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            self._streams.pop(rid, None)
            if not finished:
                self.engine.abort_request(rid)

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                # The caller's loop ends with an "abort" finish, as if the engine said so.
                stream.put(RequestOutput(rid, None, [], [
                    CompletionOutput(i, "", [], None, None, "abort")
                    for i in range(stream.num_seqs)], finished=True))
        self.engine.abort_request(ids)

    # ----- calls into the core ----------------------------------------------------------------

    async def call_utility(self, method: str, *args: Any) -> Any:
        """`EngineCore.<method>(*args)` between two steps, by name (EngineCoreClient)."""
        return await asyncio.wrap_future(self.engine.engine_core.call_utility(method, *args))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await asyncio.wrap_future(
            self.engine.engine_core.reset_prefix_cache(reset_running_requests))

    async def get_stats(self) -> EngineStats:
        stats = await asyncio.wrap_future(self.engine.engine_core.get_stats())
        return self.engine.with_front_counters(stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._front_pool.shutdown(wait=False, cancel_futures=True)
        self._chat_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.engine_core.shutdown(timeout)

    # ----- outputs ----------------------------------------------------------------------------

    async def _handle_outputs(self) -> None:
        """Each batch of core outputs -> RequestOutputs -> the requests' streams."""
        engine = self.engine
        try:
            while True:
                outputs = await engine.engine_core.get_output_async()
                step_error = outputs.step_error
                for out in engine.process_outputs(outputs):
                    self._dispatch(out, step_error)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every waiting caller hears of it
            if not isinstance(exc, EngineDeadError):
                logger.exception("the output handler failed")
            error = EngineDeadError(str(exc))
            for stream in self._streams.values():
                stream.fail(error)
            self._streams.clear()

    def _dispatch(self, out: RequestOutput, step_error: BaseException | None) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            if self.metrics is not None:
                self.metrics.record_finished(out)
            if stream is not None:
                del self._streams[out.request_id]
            failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
            if failed is not None and failed.rejected:
                if stream is not None:
                    stream.fail(RequestValidationError(
                        failed.finish_message or "invalid request",
                        failed.error_param or "structured_outputs", failed.error_code))
                return
            if failed is not None:
                message = failed.finish_message or (
                    f"{type(step_error).__name__}: {step_error}" if step_error is not None
                    else "model step failed")
                logger.error("request %s failed in the model step: %s", out.request_id,
                             message)
                if stream is not None:
                    stream.fail(RequestFailedError(out.request_id, message))
                    return
        if stream is not None:
            stream.put(out)


__all__ = ["AsyncLLM", "RequestFailedError", "RequestOutputKind", "StreamingInput",
           "merge_deltas"]
