"""EngineCore: one step = schedule -> execute -> update. Owns the request lifetimes.

It sits between the scheduler (pure Python) and the model runner (torch's, or the native one
without torch: slotserve/native) and is the only place that sees both the SchedulerOutput and
the worker's slot table, so it is also where the invariant checker runs. It knows token ids only: the front of the engine validates, tokenizes
and detokenizes, and talks to it through an EngineCoreClient (engine/core_client.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random
import time
from typing import TYPE_CHECKING, Protocol

from slotserve.check import InvariantChecker
from slotserve.check.observer import SchedulerObserver
from slotserve.check.trace import TraceRecorder
from slotserve.config import EngineConfig
from slotserve.core.outputs import (
    EngineCoreOutput,
    FinishReason,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from slotserve.core.request import Request, RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.engine.args import EngineArgs
from slotserve.engine.engine_state import EngineState, snapshot_engine_state
from slotserve.engine.loading import eos_token_ids, load_model_config, load_tokenizer
from slotserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineStats, portable
from slotserve.errors import ConfigError
from slotserve.memory import resident_bytes
from slotserve.worker.slots import RequestSlots

if TYPE_CHECKING:
    from slotserve.engine.kv_events import KVEventPublisher
    from slotserve.model_config import ModelConfig
    from slotserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class ModelRunnerProtocol(Protocol):
    """What EngineCore needs from a worker (a StepRunner: worker/model_runner.ModelRunner,
    native/runner.NativeRunner)."""

    slots: RequestSlots
    # Seconds spent in the forward pass and sampling in the last step.
    last_forward_s: float

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step; a grammar_output masks the logits of its requests before sampling
        (execute_model is called without it when no request has a grammar)."""
        ...


class EngineCore:
    def __init__(self, config: EngineConfig, model_runner: ModelRunnerProtocol,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.model_runner = model_runner
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        # Compiles grammars off the step loop and fills each step's bitmask; None: requests
        # with a grammar are refused (an engine built without a tokenizer).
        self.structured_output_manager = structured_output_manager
        self.checker = InvariantChecker(self.scheduler) if config.check else None
        # Every call that changes the scheduler goes through it: traced and checked.
        self.observer = SchedulerObserver(self.scheduler, self.checker, TraceRecorder(
            config.trace_path, config.scheduler_config, config.cache_config)
            if config.trace_path else None)
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
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint:
            from slotserve.engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events_endpoint)
            self.scheduler.kv_cache_manager.block_pool.kv_events = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, threads: int | None = None) -> EngineCore:
        """Load the model, size the KV cache from the memory budget (measured after the
        weights are in memory), then build every part from the one EngineConfig. The native
        runner (slotserve/native, no torch) where `--model-impl` and the model allow, else
        the torch model. `threads`: the CPU threads of the forward pass (default: torch's,
        OMP_NUM_THREADS or the cores)."""
        # Where the core runs, so the utilities a plugin adds to EngineCore exist there too.
        for plugin in filter(None, (args.plugins or "").split(",")):
            importlib.import_module(plugin)
        if args.seed is not None:
            random.seed(args.seed)
        if args.model_impl != "torch":
            core = cls._native(args, threads)
            if core is not None:
                return core
        import torch

        if threads:
            torch.set_num_threads(threads)
        from slotserve.checkpoint import find_gguf
        from slotserve.models.kv_storage import resolve_kv_cache_dtype
        from slotserve.models.loader import load_model, parse_dtype
        from slotserve.worker.kv_cache import determine_num_blocks
        from slotserve.worker.model_runner import ModelRunner, default_device

        path = args.model_path()
        bound = args.max_model_len_bound(load_model_config(path).max_position_embeddings)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        dtype = parse_dtype(args.dtype)
        device = default_device() if args.device == "auto" else torch.device(args.device)
        model, model_config = load_model(path, dtype, device, max_positions=bound + 1,
                                         quantization=args.quantization)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype,
                                          gguf=find_gguf(path) is not None)
        num_blocks = determine_num_blocks(model_config, args.block_size, kv_dtype, device,
                                          args.num_blocks, args.kv_cache_memory,
                                          args.max_num_seqs, bound)
        config = args.create_engine_config(model_config.max_position_embeddings, num_blocks)
        # The runner allocates what was sized here: auto resolved once, for both.
        cache_config = dataclasses.replace(config.cache_config,
                                           cache_dtype=str(kv_dtype).removeprefix("torch."))
        config = dataclasses.replace(config, cache_config=cache_config,
                                     dtype=str(dtype).removeprefix("torch."), device=str(device),
                                     model_config=model_config)
        runner = ModelRunner((model, model_config), config)
        overlap = args.grammar_bitmask_overlap
        if overlap is None:
            overlap = device.type != "cpu"
        return cls(config, runner, _structured_output_manager(
            args, path, model_config, config.scheduler_config.max_num_seqs, overlap))

    @classmethod
    def _native(cls, args: EngineArgs, threads: int | None) -> EngineCore | None:
        """The core with the native runner (no torch); None, logged, where the torch model
        must run it, or ConfigError under `--model-impl native`."""
        from slotserve.engine.native_core import build_native, native_why_not
        from slotserve.native.model import NativeUnsupported

        why = native_why_not(args)
        if why is None:
            try:
                config, runner = build_native(args, threads)
            except NativeUnsupported as exc:
                why = str(exc)
            else:
                assert config.model_config is not None
                return cls(config, runner, _structured_output_manager(
                    args, args.model_path(), config.model_config,
                    config.scheduler_config.max_num_seqs,
                    overlap=bool(args.grammar_bitmask_overlap)))
        if args.model_impl == "native":
            raise ConfigError(f"--model-impl native: {why}")
        logger.info("the torch model runs this engine: %s", why)
        return None

    # ----- requests in and out ----------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        if request.continues_session and rid not in self.scheduler.requests:
            return  # the session ended here meanwhile; the front has its end already
        structured_output_request = None
        if request.grammar is not None and not request.continues_session:
            if self.structured_output_manager is None:
                logger.info("request %s refused: no structured outputs", rid)
                self.scheduler.report_end(
                    rid, FinishReason.ERROR.value, "structured outputs are not available: "
                    "this engine was built without the model's tokenizer", rejected=True,
                    session_end=FinishReason.REFUSED if request.resumable else None)
                return
            # The scheduler keeps it WAITING_FOR_GRAMMAR until the compile is done.
            structured_output_request = self.structured_output_manager.make_request(
                request.grammar, request.client)
        self.observer.add_request(Request(
            rid, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, priority=request.priority,
            arrival_time=request.arrival_time, resumable=request.resumable,
            structured_output_request=structured_output_request, chunk=request.chunk,
            lora_request=request.lora_request, client=request.client))

    def has_waiting_grammars(self) -> bool:
        return bool(self.scheduler.waiting_for_grammar)

    def next_grammar_deadline(self) -> float | None:
        """The earliest deadline of a compile that has started (the manager wakes the loop
        when one starts or ends)."""
        manager = self.structured_output_manager
        if manager is None:
            return None
        return manager.next_deadline(self.scheduler.waiting_for_grammar.values())

    def wait_for_grammar(self, poll_s: float = 0.05) -> None:
        """Block until some waiting request's grammar is ready, or a deadline passes, or
        poll_s (a core stepped by its caller, with nothing else to do)."""
        manager = self.structured_output_manager
        if manager is None or not self.scheduler.waiting_for_grammar:
            return
        deadline = self.next_grammar_deadline()
        timeout = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
        manager.wait(self.scheduler.waiting_for_grammar.values(), timeout)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.observer.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        # Also true while releases or outputs are pending, so a step delivers them. Requests
        # waiting for a grammar do not count: the loop waits for them (has_waiting_grammars).
        return self.scheduler.has_requests()

    def has_idle_sessions(self) -> bool:
        return self.scheduler.num_waiting_for_streaming_input > 0

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        ok = self.observer.reset_prefix_cache(reset_running_requests)
        if self.kv_events is not None:
            self.publish_kv_events()
        return ok

    def get_stats(self) -> EngineStats:
        s = self.scheduler.make_stats()
        # A model runner reports what it holds (`ModelRunner.memory`); test doubles hold none.
        memory = getattr(self.model_runner, "memory", None)
        # Every SchedulerStats field as the scheduler made it (a field added there reaches
        # EngineStats and /metrics without a second list here).
        stats = EngineStats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                            num_failed_steps=self.num_failed_steps,
                            num_failed_requests=self.num_failed_requests,
                            num_steps=self.num_steps, busy_s=self.busy_s,
                            busy_cpu_s=self.busy_cpu_s,
                            weights_bytes=getattr(memory, "weights_bytes", 0),
                            quantized_weights_bytes=getattr(memory, "quantized_weights_bytes", 0),
                            kv_cache_bytes=getattr(memory, "kv_cache_bytes", 0),
                            resident_bytes=resident_bytes())
        if self.structured_output_manager is not None:
            g = self.structured_output_manager.stats
            stats.num_grammars_compiled, stats.grammar_compile_s = g.num_compiled, g.compile_s
            stats.num_grammar_mask_rows = g.num_mask_rows
            stats.grammar_mask_fill_s, stats.grammar_mask_wait_s = g.mask_fill_s, g.mask_wait_s
            stats.grammar_cache_entries, stats.grammar_cache_bytes = (g.cached_entries,
                                                                      g.cached_bytes)
        return stats

    def clear_grammar_cache(self) -> None:
        """Drop the compiled grammars (a utility: benchmarks/grammar_memory.py measures what
        the cache held)."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.clear_cache()

    def get_engine_state(self) -> EngineState:
        """Who holds each worker slot and KV block now (ids and counts, never text)."""
        return snapshot_engine_state(self.scheduler, self.model_runner.slots, self.num_steps,
                                     len(self.scheduler.waiting_for_grammar))

    def get_routing_stats(self, limit: int) -> tuple[list[bytes], int]:
        """What a prefix-aware router needs of this replica: its newest `limit` cached block
        hashes (oldest first) and its queue (running + waiting requests)."""
        hashes = list(self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
        return hashes[-limit:], len(self.scheduler.running) + len(self.scheduler.waiting)

    # ----- the step ---------------------------------------------------------------------------

    def publish_kv_events(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        if self.kv_events is not None and pool.kv_events:
            self.kv_events.publish(pool.kv_events)
            pool.kv_events = []

    def step(self) -> EngineCoreOutputs:
        if self.kv_events is not None:
            self.publish_kv_events()  # what utilities did between steps (a cache reset)
        # With only idle sessions or compiling grammars a step still runs: schedule() is
        # where sessions time out and ready grammars join the queue, so a loop ticks step()
        # now and then meanwhile.
        if not (self.scheduler.has_requests() or self.has_idle_sessions()
                or self.has_waiting_grammars()):
            self.stalled = False
            return EngineCoreOutputs()
        cpu_start, schedule_time = time.thread_time(), time.monotonic()
        try:
            return self._step(schedule_time)
        finally:
            if self.kv_events is not None:
                self.publish_kv_events()
            self.num_steps += 1
            self.busy_s += time.monotonic() - schedule_time
            self.busy_cpu_s += time.thread_time() - cpu_start

    def _step(self, schedule_time: float) -> EngineCoreOutputs:
        scheduler_output = self.observer.schedule(now=schedule_time)
        self.stalled = False
        scheduled_new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        grammar_output = None
        if self.structured_output_manager is not None:
            grammar_output = self.structured_output_manager.grammar_bitmask(
                self.scheduler.requests, scheduler_output)
        try:
            model_output = self.model_runner.execute_model(scheduler_output, grammar_output)
        except Exception as exc:
            if grammar_output is not None:
                grammar_output.ready_bitmask()  # the helper thread is done with the matchers
            return EngineCoreOutputs(self._fail_step(scheduler_output, exc), schedule_time,
                                     time.monotonic(), scheduled_new, portable(exc))
        if grammar_output is not None:
            # Done already when the worker applied it; the matchers advance only after this.
            grammar_output.ready_bitmask()
        self.total_forward_s += self.model_runner.last_forward_s
        if self.checker is not None:
            self.checker.check_worker_slots(self.model_runner.slots)
        now = time.monotonic()
        outputs = self.observer.update_from_output(scheduler_output, model_output, now=now)
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
        requests = self.scheduler.requests
        outputs = [EngineCoreOutput(rid, [], FinishReason.ERROR.value, finished=True,
                                    chunk=r.chunk, session_end=FinishReason.ERROR
                                    if r.resumable else None)
                   for rid in failed if (r := requests.get(rid)) is not None]
        self.observer.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return outputs


def _structured_output_manager(args: EngineArgs, path: str, model_config: ModelConfig,
                               max_num_seqs: int, overlap: bool) -> StructuredOutputManager:
    """Structured outputs for this model. The grammar library's tokenizer is built on the
    compile thread when the first grammar arrives, not at startup: for a 262k vocabulary it
    takes about 3 s and keeps about 280 MB resident, which an engine that never sees a
    grammar should not pay."""
    from slotserve.structured_output.backend import GuidanceBackend
    from slotserve.structured_output.manager import StructuredOutputManager

    def tokenizer_and_eos() -> tuple[object, list[int]]:
        tokenizer = load_tokenizer(args.tokenizer or path)
        return tokenizer, eos_token_ids(model_config, tokenizer)

    manager = StructuredOutputManager(
        GuidanceBackend(tokenizer_and_eos, model_config.vocab_size), max_num_seqs,
        compile_timeout_s=args.grammar_compile_timeout_s, overlap=overlap)
    return manager
