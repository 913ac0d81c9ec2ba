"""Streaming-input sessions (DESIGN.md section 3), as a mixin of the Scheduler.

A session is a resumable request. When a chunk's generation stops, the session always pauses
first (WAITING_FOR_STREAMING_REQ, keeping its KV blocks and worker slot); its next chunk is
folded in when it is promoted, and it comes back in scheduled_new_reqs with all its blocks.
A non-resumable request with the same id ends it; so does an idle timeout.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from slotserve.core.outputs import EngineCoreOutput
from slotserve.core.request import Request, RequestStatus, StreamingUpdate
from slotserve.core.sched_utils import fold_session_chunk
from slotserve.errors import RequestValidationError

if TYPE_CHECKING:
    from slotserve.core.scheduler import Scheduler

PAUSED = RequestStatus.WAITING_FOR_STREAMING_REQ


class StreamingSessionsMixin:
    def _add_session_chunk(self: Scheduler, session: Request, request: Request) -> None:  # type: ignore[misc]
        if session.streaming_queue is None:
            raise RequestValidationError(
                f"duplicate request id {request.request_id!r} (not a streaming session)",
                "request_id")
        update = request.to_streaming_update()
        if session.status != PAUSED:
            session.streaming_queue.append(update)
        elif update is None:
            self._end_paused_session(session, RequestStatus.FINISHED_ABORTED, None)
        else:
            self._promote_session(session, update)

    def _end_paused_session(self: Scheduler, session: Request, status: RequestStatus,  # type: ignore[misc]
                            message: str | None) -> None:
        del self.paused[session.request_id]
        session.status = status
        self._free_request(session)
        self._pending_outputs.append(EngineCoreOutput(
            session.request_id, [], session.get_finished_reason(), finished=True,
            finish_message=message))

    def _promote_session(self: Scheduler, session: Request, update: StreamingUpdate) -> None:  # type: ignore[misc]
        """Apply the next chunk to a paused session and queue it; it keeps KV and slot."""
        del self.paused[session.request_id]
        fold_session_chunk(session, update)
        self.kv_cache_manager.truncate_hashes(session)
        reason = self._unfittable_reason(session)
        if reason is not None:
            self.paused[session.request_id] = session
            self._end_paused_session(session, RequestStatus.FINISHED_IGNORED, reason)
            return
        session.last_active_time = time.monotonic()
        # Ahead of newcomers (FCFS): it already holds resources the worker keeps for it.
        holds = self.kv_cache_manager.holds_blocks
        self.waiting.add_resumed_request(
            session, lambda r: r.status == RequestStatus.WAITING and holds(r.request_id))

    def _handle_stopped_request(self: Scheduler, request: Request) -> bool:  # type: ignore[misc]
        """A stopped request: True if it is finished, False if a session paused (or resumed)."""
        if not request.resumable:
            return True
        queue = request.streaming_queue
        if queue and queue[0] is None:
            queue.popleft()
            return True
        # Always pause first (vLLM PR #52717); a queued chunk is applied by promotion.
        request.status = PAUSED
        request.last_active_time = time.monotonic()
        self.paused[request.request_id] = request
        if queue:
            update = queue.popleft()
            assert update is not None
            self._promote_session(request, update)
        return False

    def _expire_sessions(self: Scheduler) -> None:  # type: ignore[misc]
        now = time.monotonic()
        if now < self._next_timeout_check:  # type: ignore[has-type]
            return
        self._next_timeout_check = now + 1.0
        timeout = self.scheduler_config.streaming_session_timeout_s
        for r in [r for r in self.paused.values() if now - r.last_active_time > timeout]:
            self._end_paused_session(r, RequestStatus.FINISHED_ABORTED,
                                     f"streaming session idle for more than {timeout:g} s")
