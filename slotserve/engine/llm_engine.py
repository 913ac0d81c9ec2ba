"""LLMEngine: the synchronous engine API used by `LLM`, the CLI and `AsyncLLM`.

add_request (validate, tokenize, fan out n) -> EngineCore.step() -> OutputProcessor
(detokenize, stop strings, timestamps) -> RequestOutputs.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slotserve.checkpoint import load_tokenizer, resolve_checkpoint
from slotserve.core.request import Request
from slotserve.core.scheduler import SchedulerStats
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.engine.detokenizer import make_decode_fn
from slotserve.engine.output_processor import OutputProcessor
from slotserve.engine.processor import ProcessedRequest, Processor, PromptType, normalize_eos
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats(SchedulerStats):
    """The scheduler's snapshot plus the engine's own counters (cumulative since start)."""

    prompt_tokens_total: int
    generation_tokens_total: int
    num_failed_steps: int


def _build_model_runner(args: EngineArgs, path: str, scheduler_config: Any,
                        cache_config: Any) -> Any:
    from slotserve.worker.model_runner import ModelRunner

    device = None if args.device in (None, "auto") else args.device
    return ModelRunner(path, scheduler_config, cache_config, dtype=args.dtype, device=device,
                       kv_cache_memory=args.kv_cache_memory, seed=args.seed,
                       native_attention=args.native_attention)


class LLMEngine:
    def __init__(self, args: EngineArgs, *, model_config: Any = None, tokenizer: Any = None,
                 model_runner: Any = None) -> None:
        """Build from `args`; tests may inject any of the three parts (a fake runner, say)."""
        self.args = args
        needs_path = model_config is None or tokenizer is None or model_runner is None
        path = args.model_path() if needs_path else str(args.model)
        if model_config is None:
            model_config = resolve_checkpoint(path).config
        self.model_config = model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
            args.tokenizer or path)
        if args.seed is not None:
            import torch

            random.seed(args.seed)
            torch.manual_seed(args.seed)
        max_model_len = args.resolve_max_model_len(model_config.max_position_embeddings)
        scheduler_config = args.create_scheduler_config(max_model_len)
        cache_config = args.create_cache_config()
        if model_runner is None:
            model_runner = _build_model_runner(args, path, scheduler_config, cache_config)
        capacity = (model_runner.num_blocks - 1) * cache_config.block_size
        if max_model_len > capacity:
            # One request alone must fit into the KV cache, or it could never be scheduled.
            if args.max_model_len is not None:
                raise RequestValidationError(
                    f"max_model_len={max_model_len} does not fit into the KV cache "
                    f"({model_runner.num_blocks - 1} usable blocks of {cache_config.block_size} "
                    f"tokens = {capacity}); give more num_blocks/kv_cache_memory or a smaller "
                    "max_model_len", "max_model_len")
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache",
                           max_model_len, capacity)
            max_model_len = scheduler_config.max_model_len = capacity
        self.max_model_len = max_model_len
        self.engine_core = EngineCore(scheduler_config, cache_config, model_runner,
                                      check=args.check)
        eos = normalize_eos(self.model_config.eos_token_id)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.processor = Processor(self.tokenizer, max_model_len, self.model_config.vocab_size,
                                   eos)
        self.output_processor = OutputProcessor(make_decode_fn(self.tokenizer))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs: Any) -> LLMEngine:
        if engine_args is None:
            engine_args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineArgs or keyword arguments, not both")
        return cls(engine_args)

    # ----- requests -------------------------------------------------------------------------

    def process_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
        priority: int = 0, resumable: bool = False, arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> ProcessedRequest:
        """Validate and tokenize without submitting (raises RequestValidationError)."""
        existing = self.output_processor.groups.get(request_id)
        session = None
        if existing is not None:
            if not existing.resumable:
                raise RequestValidationError(f"request id {request_id!r} is already in use",
                                             "request_id")
            session = existing.session_num_tokens
        return self.processor.process(
            request_id, prompt, params, priority=priority, resumable=resumable,
            arrival_time=arrival_time, output_kind=output_kind, continuation_of=session)

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        added: list[str] = []
        try:
            for request in processed.requests:
                self.engine_core.add_request(request)
                added.append(request.request_id)
        except Exception:
            # All or nothing: a request with n sequences is never half submitted.
            self.engine_core.abort_requests(added)
            raise
        self.output_processor.add_request(processed)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
        priority: int = 0, resumable: bool = False, arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        session = self.output_processor.get_session(request_id)
        if session is not None and not resumable:
            self._end_session(request_id, priority)
            return
        self.add_processed_request(self.process_request(
            request_id, prompt, params, priority=priority, resumable=resumable,
            arrival_time=arrival_time, output_kind=output_kind))

    def _end_session(self, request_id: str, priority: int) -> None:
        # A non-resumable request with a session's id only marks its end; its prompt is
        # never run, so it skips the context-length checks (the session may be full).
        mark = Request(request_id, [], SamplingParams(), priority=priority)
        processed = ProcessedRequest(request_id, None, [], mark.sampling_params, [mark],
                                     RequestOutputKind.CUMULATIVE, resumable=False)
        self.add_processed_request(processed)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    # ----- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        now = time.monotonic()
        if self.engine_core.last_scheduled_new_req_ids:
            self.output_processor.mark_scheduled(self.engine_core.last_scheduled_new_req_ids,
                                                 self.engine_core.last_schedule_time)
        outputs, stopped = self.output_processor.process_outputs(core_outputs, now)
        if stopped:
            # Stop strings are found here, above the core: end those requests there (abort
            # semantics release their blocks and slot); callers see finish_reason "stop".
            self.engine_core.abort_requests(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.has_unfinished_requests()
                or self.engine_core.has_unfinished_requests())

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    @property
    def last_error(self) -> BaseException | None:
        """The last failure inside the model's forward pass (its requests ended "error")."""
        return self.engine_core.last_error

    def get_stats(self) -> EngineStats:
        s = self.engine_core.scheduler.make_stats()
        return EngineStats(
            **{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
            prompt_tokens_total=self.output_processor.num_prompt_tokens_total,
            generation_tokens_total=self.output_processor.num_generation_tokens_total,
            num_failed_steps=self.engine_core.num_failed_steps,
        )
