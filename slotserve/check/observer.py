"""The one way to call a scheduler: the five calls that change it (add_request,
finish_requests, reset_prefix_cache, schedule, update_from_output) are each written to the
trace (when recording), and each SchedulerOutput goes through the invariant checker (when
checking) before anything acts on it. EngineCore, the trace replay, the fuzzer and the
explorer drive their scheduler through it; a new scheduler call (speculative decoding,
adapters) is added here, or neither the trace nor the checker sees it. Reads go to
`observer.scheduler` directly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slotserve.check.checker import InvariantChecker
    from slotserve.check.trace import TraceRecorder
    from slotserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
    from slotserve.core.request import Request, RequestStatus
    from slotserve.core.scheduler import Scheduler


class SchedulerObserver:
    __slots__ = ("scheduler", "checker", "recorder")

    def __init__(self, scheduler: Scheduler, checker: InvariantChecker | None = None,
                 recorder: TraceRecorder | None = None) -> None:
        self.scheduler = scheduler
        self.checker = checker
        self.recorder = recorder

    def add_request(self, request: Request) -> None:
        compiling = self._compiling()
        self.scheduler.add_request(request)
        if self.recorder is not None:
            self.recorder.add_request(request)
            if request.structured_output_request is not None:
                compiling[request.request_id] = request
            self._record_ready(compiling)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, status)
        if self.recorder is not None:
            self.recorder.finish_requests(ids, status)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if self.recorder is not None:
            self.recorder.reset_prefix_cache(reset_running_requests)
        return self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        compiling = self._compiling()
        try:
            out = self.scheduler.schedule(now=now)
        except BaseException:
            if self.recorder is not None:
                self.recorder.schedule(None, now)  # the replay raises here too
            raise
        if self.recorder is not None:
            self.recorder.schedule(out, now)
            self._record_ready(compiling)
        if self.checker is not None:
            self.checker.on_schedule(out)
        return out

    def _compiling(self) -> dict[str, Request]:
        return {} if self.recorder is None else dict(self.scheduler.waiting_for_grammar)

    def _record_ready(self, compiling: dict[str, Request]) -> None:
        """The requests whose grammar the last call found ready (a replay compiles nothing:
        it is told), each with its error if it failed."""
        assert self.recorder is not None
        waiting = self.scheduler.waiting_for_grammar
        ready = {rid: r.structured_output_request.grammar.error for rid, r in compiling.items()
                 if rid not in waiting and r.structured_output_request is not None}
        if ready:
            self.recorder.grammars_ready(ready)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput,
                           now: float | None = None) -> list[EngineCoreOutput]:
        recorder = self.recorder
        if recorder is None:
            outputs = self.scheduler.update_from_output(scheduler_output, model_output, now=now)
            if self.checker is not None and scheduler_output.scheduled_spec_decode_tokens:
                self.checker.on_update(scheduler_output)
            return outputs
        recorder.update(scheduler_output, model_output, now)
        requests = self.scheduler.requests
        grammars = {rid: sor.grammar for rid in scheduler_output.num_scheduled_tokens
                    if (r := requests.get(rid)) is not None
                    and (sor := r.structured_output_request) is not None}
        outputs = self.scheduler.update_from_output(scheduler_output, model_output, now=now)
        if self.checker is not None and scheduler_output.scheduled_spec_decode_tokens:
            self.checker.on_update(scheduler_output)
        # A replay has no grammar library: it is told where each grammar completed or failed.
        recorder.grammar_outcomes([rid for rid, g in grammars.items() if g.is_terminated()],
                                  {rid: g.error for rid, g in grammars.items()
                                   if g.error is not None})
        return outputs
