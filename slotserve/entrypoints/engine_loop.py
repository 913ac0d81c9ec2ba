"""The engine loop: the one thread that ever calls the (not thread-safe) LLMEngine.

It applies queued commands, then steps, and blocks only while the engine is idle, so a busy
engine steps back to back. Two clients put it behind the same interface:

- `ThreadEngineClient` runs it on a thread of this process. Cheap to start, but the engine's
  Python work and the HTTP side's share one GIL: every torch op hands the GIL over, and the
  step waits while the event loop serializes responses.
- `ProcessEngineClient` runs it in a spawned child process and talks over a pipe, so the step
  loop never waits for the event loop (vLLM's V1 split, for the same reason).
  `benchmarks/serve_bench.py --engine-mode` measures both; process is the server default.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.processor import ProcessedRequest
from slotserve.errors import EngineDeadError
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    """What the engine loop hands to the front after a step."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests the engine refused when they were added (it validates again).
    request_errors: list[tuple[str, BaseException]] = field(default_factory=list)
    # Message of a model-step failure in this step; its requests end with "error".
    step_error: str | None = None
    # Set when the engine cannot continue: every open request fails.
    dead_error: BaseException | None = None


@dataclass(slots=True)
class EngineInfo:
    """What the front needs to validate requests without the engine object."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


@dataclass(slots=True)
class LoopStats:
    num_steps: int
    # Seconds inside engine.step() and seconds since the loop started: busy_s / wall_s is
    # how busy the front keeps the step loop.
    busy_s: float
    wall_s: float
    # CPU seconds the loop thread spent inside step(): below busy_s when the step waited
    # (for the GIL, or for a CPU taken by other processes).
    busy_cpu_s: float = 0.0
    # Seconds spent handing results to the front (in process mode: queueing them).
    post_s: float = 0.0


_ADD, _ADD_PROCESSED, _ABORT, _CALL, _STATS, _STOP = range(6)
Reply = Callable[[bool, Any], None]


def engine_info(engine: Any) -> EngineInfo:
    p = engine.processor
    eos = ([p.eos_token_id] if p.eos_token_id is not None else []) + list(p.extra_stop_token_ids)
    return EngineInfo(engine.max_model_len, p.vocab_size, eos)


class EngineLoop:
    def __init__(self, engine: Any, post: Callable[[StepResult], None]) -> None:
        self.engine = engine
        self._post = post
        self.commands: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.dead_error: BaseException | None = None
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        self.post_s = 0.0
        self.num_steps = 0
        self._started = time.perf_counter()

    def _failed_steps(self) -> int:
        return int(getattr(getattr(self.engine, "engine_core", None), "num_failed_steps", 0))

    def _last_step_error(self) -> str:
        exc = getattr(self.engine, "last_error", None)
        return f"{type(exc).__name__}: {exc}" if exc is not None else "model step failed"

    def _apply(self, kind: int, arg: Any, errors: list[tuple[str, BaseException]]) -> bool:
        engine = self.engine
        if kind == _ADD_PROCESSED:
            try:
                engine.add_processed_request(arg)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                errors.append((arg.request_id, exc))
        elif kind == _ADD:
            rid, prompt, params, priority, resumable, arrival = arg
            try:
                engine.add_request(rid, prompt, params, priority=priority, resumable=resumable,
                                   arrival_time=arrival, output_kind=RequestOutputKind.DELTA)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                errors.append((rid, exc))
        elif kind == _ABORT:
            engine.abort_request(arg)
        elif kind == _CALL:
            fn, reply = arg
            try:
                value = fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                reply(False, exc)
            else:
                reply(True, value)
        elif kind == _STATS:
            arg(True, LoopStats(self.num_steps, self.busy_s, time.perf_counter() - self._started,
                                self.busy_cpu_s, self.post_s))
        return kind != _STOP

    def run(self) -> None:
        engine, cmds = self.engine, self.commands
        failed_steps = self._failed_steps()
        running = True
        while running:
            errors: list[tuple[str, BaseException]] = []
            # Block only when idle: a busy engine must never wait for the front. Paused
            # sessions need a tick now and then: schedule() is where idle ones time out.
            ticking = _has_paused_sessions(engine)
            if engine.has_unfinished_requests():
                item = _poll(cmds)
            else:
                item = _wait(cmds, SESSION_TICK_S if ticking else None)
            while item is not None and running:
                running = self._apply(item[0], item[1], errors)
                item = _poll(cmds)
            result = StepResult(request_errors=errors)
            if running and (engine.has_unfinished_requests() or ticking):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    result.outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - the engine cannot continue
                    logger.exception("engine step failed; the engine is dead")
                    self.dead_error = result.dead_error = exc
                    running = False
                self.busy_s += time.perf_counter() - t0
                self.busy_cpu_s += time.thread_time() - c0
                self.num_steps += 1
                if self._failed_steps() != failed_steps:
                    failed_steps = self._failed_steps()
                    result.step_error = self._last_step_error()
            if result.outputs or result.request_errors or result.dead_error is not None:
                t0 = time.perf_counter()
                self._post(result)
                self.post_s += time.perf_counter() - t0
        error = EngineDeadError(str(self.dead_error or "the engine loop stopped"))
        while (item := _poll(cmds)) is not None:
            if item[0] in (_CALL, _STATS):
                reply = item[1][1] if item[0] == _CALL else item[1]
                reply(False, error)


SESSION_TICK_S = 1.0


def _has_paused_sessions(engine: Any) -> bool:
    core = getattr(engine, "engine_core", None)
    return bool(core is not None and core.scheduler.paused)


def _wait(cmds: queue.SimpleQueue[tuple[int, Any]],
          timeout: float | None) -> tuple[int, Any] | None:
    try:
        return cmds.get(timeout=timeout)
    except queue.Empty:
        return None


def _poll(cmds: queue.SimpleQueue[tuple[int, Any]]) -> tuple[int, Any] | None:
    try:
        return cmds.get_nowait()
    except queue.Empty:
        return None


def _future_reply(future: concurrent.futures.Future[Any]) -> Reply:
    def reply(ok: bool, value: Any) -> None:
        if future.set_running_or_notify_cancel():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
    return reply


class ThreadEngineClient:
    """The engine loop on a daemon thread of this process."""

    def __init__(self, engine: Any, on_result: Callable[[StepResult], None]) -> None:
        self.info = engine_info(engine)
        self._loop = EngineLoop(engine, on_result)
        self._thread = threading.Thread(target=self._loop.run, name="slotserve-engine-loop",
                                        daemon=True)
        self._thread.start()

    @property
    def dead_error(self) -> BaseException | None:
        return self._loop.dead_error

    def _put(self, kind: int, arg: Any) -> None:
        self._loop.commands.put((kind, arg))

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        self._put(_ADD_PROCESSED, processed)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None, *,
                    priority: int, resumable: bool, arrival_time: float | None = None) -> None:
        self._put(_ADD, (request_id, prompt, params, priority, resumable, arrival_time))

    def abort(self, request_ids: list[str]) -> None:
        self._put(_ABORT, request_ids)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(_CALL, (fn, _future_reply(future)))
        return future

    def loop_stats(self) -> concurrent.futures.Future[LoopStats]:
        future: concurrent.futures.Future[LoopStats] = concurrent.futures.Future()
        self._put(_STATS, _future_reply(future))
        return future

    def stop(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._put(_STOP, None)
            self._thread.join(timeout)


# ----------------------------------------------------------------------------- process mode

def _portable(exc: BaseException) -> BaseException:
    """An exception that survives the pipe (or a RuntimeError carrying its text)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _compact(result: StepResult) -> StepResult:
    """Strip what the front has already: the prompt (AsyncLLM knows what it sent), and the
    per-token timestamps until a request finishes (they are only read then)."""
    outputs = []
    for out in result.outputs:
        metrics = out.metrics
        if not out.finished and metrics is not None and metrics.token_times:
            metrics = dataclasses.replace(metrics, token_times=[])
        outputs.append(dataclasses.replace(out, prompt=None, prompt_token_ids=None,
                                           metrics=metrics))
    errors = [(rid, _portable(e)) for rid, e in result.request_errors]
    dead = _portable(result.dead_error) if result.dead_error is not None else None
    return StepResult(outputs, errors, result.step_error, dead)


def _child_main(conn: Any, engine_kwargs: dict[str, Any], threads: int | None,
                log_level: int) -> None:
    import signal

    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        from slotserve.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(**engine_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", _portable(exc)))
        return
    conn.send(("ready", engine_info(engine)))
    # The engine thread only queues its results; a sender thread pickles and writes them, so
    # a step never waits on the pipe, and pickling overlaps the next forward pass (torch
    # releases the GIL). Whatever piled up meanwhile goes out as one message.
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    loop = EngineLoop(engine, lambda r: outbox.put(("step", _compact(r))))

    def send_results() -> None:
        done = False
        while not done:
            batch = [outbox.get()]
            while (item := _poll(outbox)) is not None:
                batch.append(item)
            if None in batch:
                done = True
                batch = [m for m in batch if m is not None]
            if batch:
                try:
                    conn.send(batch)
                except (OSError, ValueError):
                    return  # the parent is gone

    def reply_for(call_id: int) -> Reply:
        return lambda ok, value: outbox.put(("reply", call_id, ok,
                                             value if ok else _portable(value)))

    def read_commands() -> None:
        # The engine thread never waits on the pipe: commands land in its queue.
        while True:
            try:
                kind, arg = conn.recv()
            except (EOFError, OSError):
                kind, arg = _STOP, None
            if kind in (_CALL, _STATS):
                call_id, fn = arg
                arg = (fn, reply_for(call_id)) if kind == _CALL else reply_for(call_id)
            loop.commands.put((kind, arg))
            if kind == _STOP:
                return

    sender = threading.Thread(target=send_results, name="slotserve-engine-results")
    sender.start()
    threading.Thread(target=read_commands, name="slotserve-engine-commands",
                     daemon=True).start()
    try:
        loop.run()
    finally:
        outbox.put(None)  # flush what is queued, then let the process end
        sender.join(30)


class ProcessEngineClient:
    """The engine loop in a spawned child process; commands and results cross a pipe."""

    def __init__(self, engine_kwargs: dict[str, Any], on_result: Callable[[StepResult], None],
                 *, threads: int | None = None, startup_timeout_s: float = 600.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, name="slotserve-engine",
                                 args=(child_conn, engine_kwargs, threads,
                                       logging.getLogger().getEffectiveLevel()), daemon=True)
        self._proc.start()
        child_conn.close()
        if not self._conn.poll(startup_timeout_s):
            self._proc.kill()
            raise EngineDeadError("the engine process did not start in time")
        try:
            kind, payload = self._conn.recv()
        except EOFError as exc:
            raise EngineDeadError(f"the engine process exited with code "
                                  f"{self._proc.exitcode} while starting") from exc
        if kind == "failed":
            self._proc.join(10)
            raise payload
        self.info: EngineInfo = payload
        self.dead_error: BaseException | None = None
        self._on_result = on_result
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._next_call = 0
        self._reader = threading.Thread(target=self._read, name="slotserve-engine-results",
                                        daemon=True)
        self._reader.start()

    def _send(self, kind: int, arg: Any) -> None:
        if self.dead_error is not None:
            return
        with self._send_lock:
            try:
                self._conn.send((kind, arg))
            except (OSError, ValueError) as exc:
                logger.error("cannot reach the engine process: %s", exc)

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        # The child rebuilds the core Requests: sending token ids once is cheaper than
        # pickling n Requests that each hold copies of them.
        first = processed.requests[0]
        self._send(_ADD, (processed.request_id,
                          {"prompt_token_ids": processed.prompt_token_ids,
                           "prompt": processed.prompt},
                          processed.params, first.priority, False, first.arrival_time))

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None, *,
                    priority: int, resumable: bool, arrival_time: float | None = None) -> None:
        self._send(_ADD, (request_id, prompt, params, priority, resumable, arrival_time))

    def abort(self, request_ids: list[str]) -> None:
        self._send(_ABORT, request_ids)

    def _new_call(self, kind: int, fn: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.dead_error is not None:
            future.set_exception(EngineDeadError(str(self.dead_error)))
            return future
        with self._send_lock:
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = future
            self._conn.send((kind, (call_id, fn)))
        return future

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """`fn` must pickle (a module-level function or a functools.partial of one)."""
        return self._new_call(_CALL, fn)

    def loop_stats(self) -> concurrent.futures.Future[LoopStats]:
        return self._new_call(_STATS, None)

    def _read(self) -> None:
        while self.dead_error is None:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            for msg in batch:
                if msg[0] == "reply":
                    _, call_id, ok, value = msg
                    future = self._calls.pop(call_id, None)
                    if future is not None:
                        _future_reply(future)(ok, value)
                    continue
                result: StepResult = msg[1]
                if result.dead_error is not None:
                    self.dead_error = result.dead_error
                self._on_result(result)
        if self.dead_error is None:
            code = self._proc.exitcode
            self.dead_error = EngineDeadError(
                "the engine process stopped" + (f" (exit code {code})" if code else ""))
            self._on_result(StepResult(dead_error=self.dead_error))
        for future in list(self._calls.values()):
            _future_reply(future)(False, EngineDeadError(str(self.dead_error)))
        self._calls.clear()

    def stop(self, timeout: float) -> None:
        if self._proc.is_alive():
            self._send(_STOP, None)
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._conn.close()
