"""EngineCore: one step = schedule -> execute -> update. Owns the request lifetimes.

It sits between the scheduler (pure Python) and the model runner (torch) and is the only
place that sees both the SchedulerOutput and the worker's slot table, so it is also where the
invariant checker runs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

from slotserve.check import InvariantChecker, checking_enabled
from slotserve.check.trace import TraceRecorder
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from slotserve.core.request import Request, RequestStatus
from slotserve.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


class ModelRunnerProtocol(Protocol):
    """What EngineCore needs from a worker (slotserve.worker.model_runner.ModelRunner)."""

    slots: Any
    num_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 model_runner: ModelRunnerProtocol, check: bool = False) -> None:
        if cache_config.num_blocks is None:
            # The runner sized the KV cache from its memory budget; the scheduler's block
            # pool must have exactly as many blocks as the runner's cache tensors.
            cache_config.num_blocks = model_runner.num_blocks
        elif cache_config.num_blocks != model_runner.num_blocks:
            raise ValueError(f"cache_config.num_blocks={cache_config.num_blocks} but the model "
                             f"runner allocated {model_runner.num_blocks} blocks")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.model_runner = model_runner
        self.scheduler = Scheduler(scheduler_config, cache_config)
        # check=True, or SLOTSERVE_CHECK=1 in the environment (turns it on for any engine).
        self.checker: InvariantChecker | None = None
        if checking_enabled(True if check else None):
            self.checker = InvariantChecker(self.scheduler)
        # The last failure inside execute_model; a server reads it to report itself unhealthy.
        self.last_error: BaseException | None = None
        self.num_failed_steps = 0
        # For the front end's timestamps: who was (re)admitted in the last step, and when.
        self.last_scheduled_new_req_ids: list[str] = []
        self.last_schedule_time = 0.0
        # For the engine-overhead measurement (benchmarks/offline_throughput.py).
        self.num_steps = 0
        self.total_forward_s = 0.0
        # SLOTSERVE_TRACE=PATH records every scheduler event for a deterministic replay.
        trace_path = os.environ.get("SLOTSERVE_TRACE")
        self.trace = (TraceRecorder(trace_path, scheduler_config, cache_config)
                      if trace_path else None)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if self.trace is not None:
            self.trace.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
            if self.trace is not None:
                self.trace.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        # Also true while releases are pending, so a final step delivers them to the worker.
        return self.scheduler.has_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if self.trace is not None:
            self.trace.reset_prefix_cache(reset_running_requests)
        return self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def step(self) -> list[EngineCoreOutput]:
        # With only paused sessions a step still runs: schedule() is where idle sessions time
        # out, so a server ticks step() now and then while sessions are paused.
        if not self.scheduler.has_requests() and not self.scheduler.paused:
            self.last_scheduled_new_req_ids = []
            return []
        scheduler_output = self.scheduler.schedule()
        if self.trace is not None:
            self.trace.schedule(scheduler_output)
        self.last_schedule_time = time.monotonic()
        self.last_scheduled_new_req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        if self.checker is not None:
            self.checker.on_schedule(scheduler_output)
        try:
            model_output = self.model_runner.execute_model(scheduler_output)
        except Exception as exc:
            return self._fail_step(scheduler_output, exc)
        self.num_steps += 1
        self.total_forward_s += getattr(self.model_runner, "last_forward_s", 0.0)
        if self.checker is not None:
            self.checker.check_worker_slots(self.model_runner.slots)
        if self.trace is not None:
            self.trace.update(scheduler_output, model_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        # Drained means nothing at all: paused sessions still hold KV and a slot.
        if (self.checker is not None and not self.scheduler.requests
                and not self.scheduler.has_requests()):
            self.checker.assert_drained()
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   exc: Exception) -> list[EngineCoreOutput]:
        """The forward pass failed: end exactly the requests it was running, keep the rest.

        The error is recorded (not raised) so that the caller gets "error" outputs for these
        requests and can decide itself whether to keep serving or report itself unhealthy.
        """
        self.last_error = exc
        self.num_failed_steps += 1
        failed = list(scheduler_output.num_scheduled_tokens)
        logger.error("execute_model failed (%s: %s); finishing requests %s with an error",
                     type(exc).__name__, exc, failed, exc_info=exc)
        # FINISHED_ERROR also drops the prefix-cache entries of these requests' blocks: they
        # were registered when scheduled, but their K/V was never written.
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        if self.trace is not None:
            self.trace.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finish_reason="error", finished=True) for rid in failed]
