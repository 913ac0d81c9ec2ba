"""EngineCoreClient: how the engine's front talks to its core, wherever the core runs.

- `InprocClient`: the core in the caller's thread; `get_output()` runs one step (LLM,
  `slotserve generate`).
- `ThreadClient`: the step loop (core_loop.py) on a thread of this process. Cheap to start,
  but the core's Python work and the front's share one GIL.
- `ProcessClient`: the step loop in a child process (core_process.py), over a socket, so the step loop
  never waits for the front's event loop (vLLM's V1 split, for the same reason). A killed or
  failed child is noticed at once (the reader waits on the process sentinel too) and every
  waiting caller gets EngineDeadError.

All three take the same typed messages (engine/messages.py) and hand back EngineCoreOutputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing.connection
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Literal

from slotserve.config import EngineConfig
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.engine.core_loop import (
    EngineCoreLoop,
    EngineDead,
    LoopMessage,
)
from slotserve.engine.core_process import EngineProcess
from slotserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    UtilityCall,
    UtilityResult,
)
from slotserve.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)

EngineMode = Literal["inproc", "thread", "process"]


class EngineCoreClient(ABC):
    #: The configuration the core decided at startup (KV blocks, max_model_len, ...).
    config: EngineConfig

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (in process: one step). Raises EngineDeadError."""

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """`EngineCore.<method>(*args)` between two steps (arguments and result pickle in
        process mode). The core's vocabulary, as the front uses it, is the methods below."""

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None:
        """Why the core cannot continue, once it cannot."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None: ...

    def needs_step(self) -> bool:
        """Whether the caller must step the core for work the front cannot see (the last
        slot releases of a core in this thread); a background core steps on its own."""
        return False

    def reset_prefix_cache(self, reset_running_requests: bool
                           ) -> concurrent.futures.Future[bool]:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def get_stats(self) -> concurrent.futures.Future[EngineStats]:
        return self.call_utility("get_stats")


def make_client(mode: EngineMode, args: EngineArgs, *,
                threads: int | None = None) -> EngineCoreClient:
    """Build the core from `args` where `mode` says (`threads`: its forward pass's CPU
    threads; None: the default)."""
    if mode == "inproc":
        return InprocClient(EngineCore.from_engine_args(args, threads))
    if mode == "thread":
        return ThreadClient(EngineCore.from_engine_args(args, threads))
    if mode == "process":
        return ProcessClient(args, threads=threads)
    raise ConfigError(f"unknown engine mode {mode!r}; use inproc, thread or process")


class InprocClient(EngineCoreClient):
    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.config = engine_core.config

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        core = self.engine_core
        if not core.has_requests() and core.has_waiting_grammars():
            core.wait_for_grammar()  # nothing else to step for
        return core.step()

    async def get_output_async(self) -> EngineCoreOutputs:
        return self.get_output()

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(getattr(self.engine_core, method)(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        return future

    @property
    def dead_error(self) -> BaseException | None:
        return None  # a failing step raises in the caller

    def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def needs_step(self) -> bool:
        return self.engine_core.has_requests() or self.engine_core.has_waiting_grammars()


class _Inbox:
    """Output batches from a producer thread to the one consumer, blocking or on an event
    loop; once closed, a consumer that has taken everything gets the closing error."""

    def __init__(self) -> None:
        self._items: deque[EngineCoreOutputs] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def put(self, item: EngineCoreOutputs | None, error: BaseException | None = None) -> None:
        with self._cond:
            if item is not None:
                self._items.append(item)
            self._error = self._error or error
            self._cond.notify_all()
            if self._waiter is not None:
                (loop, future), self._waiter = self._waiter, None
                with contextlib.suppress(RuntimeError):  # the consumer's loop has closed
                    loop.call_soon_threadsafe(_wake, future)

    def _take(self) -> EngineCoreOutputs | None:
        if self._items:
            return self._items.popleft()
        if self._error is not None:
            raise self._error
        return None

    def get(self) -> EngineCoreOutputs:
        with self._cond:
            while (item := self._take()) is None:
                self._cond.wait()
            return item

    async def get_async(self) -> EngineCoreOutputs:
        while True:
            with self._cond:
                if (item := self._take()) is not None:
                    return item
                future = asyncio.get_running_loop().create_future()
                self._waiter = (asyncio.get_running_loop(), future)
            await future


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _BackgroundClient(EngineCoreClient):
    """What the thread and process clients share: utility calls answered by id, output
    batches through an inbox, and one way to die."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._inbox = _Inbox()
        self._lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._next_call = 0
        self._dead_error: BaseException | None = None

    @abstractmethod
    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None: ...

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self._inbox.get()

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._inbox.get_async()

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead_error is not None:
                future.set_exception(EngineDeadError(str(self._dead_error)))
                return future
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, args))
        return future

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def _receive(self, message: LoopMessage) -> None:
        """Called on the thread that hears from the loop."""
        if isinstance(message, EngineCoreOutputs):
            self._inbox.put(message)
        elif isinstance(message, UtilityResult):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                if message.failed:
                    future.set_exception(message.value)
                else:
                    future.set_result(message.value)
        else:
            self._die(message.error)

    def _die(self, error: BaseException) -> None:
        dead = EngineDeadError(str(error))
        with self._lock:
            if self._dead_error is not None:
                return
            self._dead_error = error
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(dead)
        self._inbox.put(None, dead)


class ThreadClient(_BackgroundClient):
    def __init__(self, engine_core: EngineCore) -> None:
        super().__init__(engine_core.config)
        self._loop = EngineCoreLoop(engine_core, self._receive)
        self._thread = threading.Thread(target=self._loop.run, name="slotserve-core-loop",
                                        daemon=True)
        self._thread.start()

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self._loop.inputs.put((kind, payload))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._send(EngineCoreRequestType.SHUTDOWN, None)
            self._thread.join(timeout)
        self._die(EngineDeadError("the engine core was shut down"))


class ProcessClient(_BackgroundClient):
    def __init__(self, args: EngineArgs, *, threads: int | None = None,
                 startup_timeout_s: float = 600.0) -> None:
        self._proc = EngineProcess(args, threads, logging.getLogger().getEffectiveLevel())
        self._conn = self._proc.conn
        if not self._conn.poll(startup_timeout_s):
            self._proc.kill()
            raise EngineDeadError("the engine process did not start in time")
        try:
            ready = self._conn.recv()
        except EOFError as exc:
            raise EngineDeadError(f"the engine process exited with code "
                                  f"{self._proc.exitcode} while starting") from exc
        if isinstance(ready, BaseException):
            self._proc.join(10)
            raise ready
        super().__init__(ready)
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="slotserve-core-client",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self._dead_error is not None:
            return
        with self._send_lock:
            try:
                self._conn.send((kind, payload))
            except (OSError, ValueError) as exc:
                logger.error("cannot reach the engine process: %s", exc)

    def _read(self) -> None:
        error: BaseException | None = None
        while error is None:
            # The sentinel too: a killed child is noticed even if its pipe stayed open.
            ready = multiprocessing.connection.wait(
                [self._conn] if self._proc.sentinel is None
                else [self._conn, self._proc.sentinel])
            if self._conn not in ready:
                break
            try:
                batch: list[LoopMessage] = self._conn.recv()
            except (EOFError, OSError):
                break
            for message in batch:
                if isinstance(message, EngineDead):
                    error = message.error
                else:
                    self._receive(message)
        if error is None:
            self._proc.join(1)
            code = self._proc.exitcode
            error = EngineDeadError("the engine process stopped"
                                    + (f" (exit code {code})" if code else ""))
        self._die(error)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc.is_alive():
            self._send(EngineCoreRequestType.SHUTDOWN, None)
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._reader.join(5)
        self._proc.close()
