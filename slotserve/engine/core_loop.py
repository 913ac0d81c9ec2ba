"""The step loop: the one thread that ever calls the (not thread-safe) EngineCore, and the
threads around it when it runs in a child process.

One state machine:

    RUNNING --SHUTDOWN request or closed pipe--> STOPPED
       |
       +--------- a step raises -------------> DEAD    (EngineDead goes out first)

While RUNNING it applies the queued requests, then steps; it blocks for input only while the
core is idle (ticking once a second while sessions are idle: schedule() is where they time
out) or stalled (a step that did nothing: requests wait for a slot that an idle session keeps
within its grace period; it ticks every STALL_TICK_S then), so a busy core steps back to back. Whatever it produces (output batches, utility
results, EngineDead) goes to one `send` callable: the client's inbox on a thread, or the pipe
in a child process. Once it leaves RUNNING, utility calls still queued fail with
EngineDeadError.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from slotserve.core.outputs import EngineCoreOutput
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
    portable,
)
from slotserve.errors import EngineDeadError
from slotserve.gc_freeze import freeze_long_lived, thaw
from slotserve.gil_switch import shorten_switch_interval
from slotserve.memory import page_out_libraries

logger = logging.getLogger(__name__)

SESSION_TICK_S = 1.0
# How often a stalled core looks again: the resolution of the idle-slot grace period.
STALL_TICK_S = 0.05


class LoopState(enum.Enum):
    RUNNING = enum.auto()
    STOPPED = enum.auto()
    DEAD = enum.auto()


@dataclass(slots=True)
class EngineDead:
    """The last message of a loop whose step raised: the core cannot continue."""

    error: BaseException


LoopMessage = EngineCoreOutputs | UtilityResult | EngineDead
LoopInput = tuple[EngineCoreRequestType, Any]


class EngineCoreLoop:
    def __init__(self, core: EngineCore, send: Callable[[LoopMessage], None]) -> None:
        self.core = core
        self.send = send
        self.inputs: queue.SimpleQueue[LoopInput] = queue.SimpleQueue()
        self.state = LoopState.RUNNING
        if core.structured_output_manager is not None:
            # A compile that starts or ends wakes a loop that waits with nothing else to do.
            core.structured_output_manager.on_progress = lambda: self.inputs.put(
                (EngineCoreRequestType.WAKE, None))

    def run(self) -> None:
        # The core is built: its model and tables live as long as the loop, so GC passes
        # during steps need not walk them (gc_freeze); thawed when the loop ends.
        freeze_long_lived("engine core")
        try:
            self._run()
        finally:
            thaw()

    def _run(self) -> None:
        core = self.core
        while self.state is LoopState.RUNNING:
            ticking = core.has_idle_sessions()
            grammars = core.has_waiting_grammars()
            stalled = core.stalled and core.has_requests()
            item = _next(self.inputs, stalled or not core.has_requests(),
                         self._wait_timeout(stalled, ticking))
            while item is not None and self.state is LoopState.RUNNING:
                self._apply(*item)
                item = _next(self.inputs)
            if self.state is LoopState.RUNNING and (core.has_requests() or ticking or grammars
                                                    or core.has_waiting_grammars()):
                self._step()
        error = EngineDeadError("the engine core has stopped")
        while (item := _next(self.inputs)) is not None:
            if item[0] is EngineCoreRequestType.UTILITY:
                self.send(UtilityResult(item[1].call_id, error, failed=True))

    def _wait_timeout(self, stalled: bool, ticking: bool) -> float | None:
        """How long the loop may block for input: a stalled core's tick, the next session
        tick, or the deadline of a running compile (a request whose grammar is overdue is
        refused in step())."""
        timeout = STALL_TICK_S if stalled else SESSION_TICK_S if ticking else None
        deadline = self.core.next_grammar_deadline()
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic()) + 0.001
            timeout = left if timeout is None else min(timeout, left)
        return timeout

    def _apply(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if kind is EngineCoreRequestType.ADD:
            try:
                self.core.add_request(payload)
            except Exception as exc:  # noqa: BLE001 - the request fails, the core goes on
                # The front validated it, so the front and the core disagree: end it visibly.
                logger.error("the engine core refused request %s: %s", payload.request_id, exc)
                self.send(EngineCoreOutputs([EngineCoreOutput(
                    payload.request_id, [], "error", finished=True, finish_message=str(exc),
                    chunk=payload.chunk)]))
        elif kind is EngineCoreRequestType.ABORT:
            self.core.abort_requests(payload)
        elif kind is EngineCoreRequestType.WAKE:
            pass  # run() steps next, and step() admits what compiled
        elif kind is EngineCoreRequestType.UTILITY:
            call: UtilityCall = payload
            try:
                self.send(UtilityResult(call.call_id,
                                        getattr(self.core, call.method)(*call.args)))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.send(UtilityResult(call.call_id, portable(exc), failed=True))
        else:
            self.state = LoopState.STOPPED

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:  # noqa: BLE001 - the core cannot continue
            logger.exception("engine step failed; the engine is dead")
            self.state = LoopState.DEAD
            self.send(EngineDead(portable(exc)))
            return
        if outputs.outputs or outputs.scheduled_new_req_ids or outputs.step_error is not None:
            self.send(outputs)


def _next(inputs: queue.SimpleQueue[LoopInput], block: bool = False,
          timeout: float | None = None) -> LoopInput | None:
    try:
        return inputs.get(block, timeout)
    except queue.Empty:
        return None


# ----------------------------------------------------------------------------- process mode

def run_engine_core_process(conn: Connection, args: EngineArgs, threads: int | None,
                            log_level: int) -> None:
    """The child process: build the core, report its decided EngineConfig (or the startup
    error), then run the loop on this thread between two pipe threads.

    The loop never waits on the pipe: a reader thread queues what arrives, and a sender
    thread pickles and writes what the loop produces, so pickling overlaps the next forward
    pass (torch releases the GIL); whatever piled up meanwhile goes out as one message.
    """
    import signal

    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # The step loop shares the GIL with the pipe threads and the grammar compiles.
        shorten_switch_interval()
        core = EngineCore.from_engine_args(args, threads)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(portable(exc))
        return
    conn.send(core.config)
    # Startup is over: the library code only importing and loading ran need not stay
    # resident in this process (memory.page_out_libraries).
    page_out_libraries()
    outbox: queue.SimpleQueue[LoopMessage | None] = queue.SimpleQueue()
    loop = EngineCoreLoop(core, outbox.put)

    def send_messages() -> None:
        while True:
            batch = [outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get())
            done = None in batch
            try:
                conn.send([m for m in batch if m is not None])
            except (OSError, ValueError):
                return  # the parent is gone
            if done:
                return

    def read_inputs() -> None:
        while True:
            try:
                item: LoopInput = conn.recv()
            except (EOFError, OSError):
                item = (EngineCoreRequestType.SHUTDOWN, None)
            loop.inputs.put(item)
            if item[0] is EngineCoreRequestType.SHUTDOWN:
                return

    sender = threading.Thread(target=send_messages, name="slotserve-core-output")
    sender.start()
    threading.Thread(target=read_inputs, name="slotserve-core-input", daemon=True).start()
    try:
        loop.run()
    finally:
        outbox.put(None)  # flush what is queued, then let the process end
        sender.join(30)
