"""EngineCore: one step = schedule -> execute -> update. Owns the request lifetimes.

It sits between the scheduler (pure Python) and the model runner (torch) and is the only
place that sees both the SchedulerOutput and the worker's slot table, so it is also where the
invariant checker runs. It knows token ids only: the front of the engine validates, tokenizes
and detokenizes, and talks to it through an EngineCoreClient (engine/core_client.py).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Protocol

from slotserve.check import InvariantChecker
from slotserve.check.trace import TraceRecorder
from slotserve.config import EngineConfig
from slotserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from slotserve.core.request import Request, RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.engine.args import EngineArgs
from slotserve.engine.loading import load_model_config
from slotserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineStats, portable
from slotserve.worker.slots import RequestSlots

logger = logging.getLogger(__name__)


class ModelRunnerProtocol(Protocol):
    """What EngineCore needs from a worker (slotserve.worker.model_runner.ModelRunner)."""

    slots: RequestSlots
    # Seconds spent in the forward pass and sampling in the last step.
    last_forward_s: float

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, config: EngineConfig, model_runner: ModelRunnerProtocol) -> None:
        self.config = config
        self.model_runner = model_runner
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        self.checker = InvariantChecker(self.scheduler) if config.check else None
        self.trace = (TraceRecorder(config.trace_path, config.scheduler_config,
                                    config.cache_config) if config.trace_path else None)
        # The last failure inside execute_model; its requests ended with "error".
        self.last_error: BaseException | None = None
        self.num_failed_steps = 0
        # Steps run and the wall / CPU seconds inside them (how busy the front keeps the
        # core), and the forward passes' share (benchmarks/offline_throughput.py).
        self.num_steps = 0
        self.busy_s = self.busy_cpu_s = self.total_forward_s = 0.0
        # Requests the worker failed alone (the rest of their steps ran).
        self.num_failed_requests = 0
        # The last step scheduled nothing and produced nothing (requests wait for a slot an
        # idle session keeps within its grace period): the loop waits a little instead of
        # spinning.
        self.stalled = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> EngineCore:
        """Load the model, size the KV cache from the memory budget (measured after the
        weights are in memory), then build every part from the one EngineConfig."""
        import torch

        from slotserve.models.loader import load_model, parse_dtype
        from slotserve.worker.kv_cache import determine_num_blocks
        from slotserve.worker.model_runner import ModelRunner, default_device

        path = args.model_path()
        bound = args.max_model_len_bound(load_model_config(path).max_position_embeddings)
        if args.seed is not None:
            random.seed(args.seed)
            torch.manual_seed(args.seed)
        dtype = parse_dtype(args.dtype)
        device = default_device() if args.device == "auto" else torch.device(args.device)
        model, model_config = load_model(path, dtype, device, max_positions=bound + 1)
        num_blocks = determine_num_blocks(model_config, args.block_size, dtype, device,
                                          args.num_blocks, args.kv_cache_memory,
                                          args.max_num_seqs, bound)
        config = args.create_engine_config(model_config.max_position_embeddings, num_blocks)
        runner = ModelRunner((model, model_config), config.scheduler_config,
                             config.cache_config, dtype=dtype, device=device, seed=args.seed,
                             native_attention=args.native_attention)
        return cls(config, runner)

    # ----- requests in and out ----------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.continues_session and request.request_id not in self.scheduler.requests:
            return  # the session ended here meanwhile; the front has its end already
        r = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                    eos_token_id=request.eos_token_id, priority=request.priority,
                    arrival_time=request.arrival_time, resumable=request.resumable)
        self.scheduler.add_request(r)
        if self.trace is not None:
            self.trace.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            if self.trace is not None:
                self.trace.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        # Also true while releases are pending, so a final step delivers them to the worker.
        return self.scheduler.has_requests()

    def has_idle_sessions(self) -> bool:
        return self.scheduler.num_waiting_for_streaming_input > 0

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if self.trace is not None:
            self.trace.reset_prefix_cache(reset_running_requests)
        return self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.make_stats()
        return EngineStats(s.num_running_reqs, s.num_waiting_reqs, s.num_paused_sessions,
                           s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                           s.num_preemptions, s.num_slots_held, s.num_idle_slots_reclaimed,
                           num_failed_steps=self.num_failed_steps,
                           num_failed_requests=self.num_failed_requests,
                           num_steps=self.num_steps, busy_s=self.busy_s,
                           busy_cpu_s=self.busy_cpu_s)

    # ----- the step ---------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        # With only idle sessions a step still runs: schedule() is where they time out, so a
        # loop ticks step() now and then while sessions are idle.
        if not self.scheduler.has_requests() and not self.has_idle_sessions():
            self.stalled = False
            return EngineCoreOutputs()
        cpu_start, schedule_time = time.thread_time(), time.monotonic()
        try:
            return self._step(schedule_time)
        finally:
            self.num_steps += 1
            self.busy_s += time.monotonic() - schedule_time
            self.busy_cpu_s += time.thread_time() - cpu_start

    def _step(self, schedule_time: float) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule(now=schedule_time)
        self.stalled = False
        if self.trace is not None:
            self.trace.schedule(scheduler_output, schedule_time)
        if self.checker is not None:
            self.checker.on_schedule(scheduler_output)
        scheduled_new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        try:
            model_output = self.model_runner.execute_model(scheduler_output)
        except Exception as exc:
            return EngineCoreOutputs(self._fail_step(scheduler_output, exc), schedule_time,
                                     time.monotonic(), scheduled_new, portable(exc))
        self.total_forward_s += self.model_runner.last_forward_s
        if self.checker is not None:
            self.checker.check_worker_slots(self.model_runner.slots)
        now = time.monotonic()
        if self.trace is not None:
            self.trace.update(scheduler_output, model_output, now)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output, now=now)
        if model_output.failed:
            self.num_failed_requests += len(model_output.failed)
        self.stalled = not scheduler_output.total_num_scheduled_tokens and not outputs
        # Drained means nothing at all: idle sessions still hold KV and a slot.
        if (self.checker is not None and not self.scheduler.requests
                and not self.scheduler.has_requests()):
            self.checker.assert_drained()
        return EngineCoreOutputs(outputs, schedule_time, now, scheduled_new)

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   exc: Exception) -> list[EngineCoreOutput]:
        """The forward pass failed: end exactly the requests it was running, keep the rest.

        The error is reported (not raised) so that the front gets "error" outputs for these
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
