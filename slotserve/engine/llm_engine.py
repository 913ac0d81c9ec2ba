"""LLMEngine: the front of the engine, used by `LLM`, the CLI and `AsyncLLM`.

add_request (validate, tokenize, fan out n) -> EngineCoreRequests -> the core, wherever it runs
(EngineCoreClient) -> EngineCoreOutputs -> OutputProcessor (detokenize, stop strings,
timestamps) -> RequestOutputs. Not thread-safe: one thread, or one event loop, calls it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from slotserve.checkpoint.tokenizer import backend_tokenizer
from slotserve.engine.args import EngineArgs
from slotserve.engine.core_client import EngineCoreClient, EngineMode, make_client
from slotserve.engine.loading import eos_token_ids, load_tokenizer
from slotserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineStats
from slotserve.engine.output_processor import OutputProcessor
from slotserve.engine.processor import ProcessedRequest, Processor, PromptType
from slotserve.errors import RequestValidationError
from slotserve.lora.request import LoRARequest
from slotserve.memory import trim_heap
from slotserve.model_config import ModelConfig
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from slotserve.checkpoint.saved_tokenizer import SavedTokenizer


def check_session_chunk(session_spec: StructuredOutputsParams | None,
                        params: SamplingParams | None) -> None:
    """A session's grammar is set by its first chunk and spans all of them: a later chunk may
    repeat it or leave it out, not change it."""
    spec = params.structured_outputs if isinstance(params, SamplingParams) else None
    if spec is not None and spec != session_spec:
        raise RequestValidationError(
            "a streaming session's structured outputs are set by its first chunk; later "
            "chunks may repeat them or leave them out", "structured_outputs")
    if session_spec is not None and isinstance(params, SamplingParams) and params.min_tokens:
        raise RequestValidationError("min_tokens cannot be combined with structured outputs "
                                     "(the grammar decides where the output ends)",
                                     "min_tokens")


def _core_model_config(client: EngineCoreClient) -> ModelConfig:
    """The model's config as the core read it with the weights: the front does not read the
    checkpoint again (in a front process of its own that would import numpy and gguf)."""
    model_config = client.config.model_config
    assert model_config is not None, "EngineCore.from_engine_args sets it"
    return model_config


class LLMEngine:
    def __init__(self, engine_core: EngineCoreClient,
                 tokenizer: PreTrainedTokenizerBase | SavedTokenizer,
                 model_config: ModelConfig) -> None:
        self.engine_core = engine_core
        self.tokenizer = tokenizer
        self.model_config = model_config
        # Decided by the core at startup: the front validates against the same limits.
        self.config = engine_core.config
        self.max_model_len = self.config.max_model_len
        self.processor = Processor(
            tokenizer, self.max_model_len, model_config.vocab_size,
            eos_token_ids(model_config, tokenizer),
            priority_policy=self.config.scheduler_config.policy == "priority")
        self.output_processor = OutputProcessor(backend_tokenizer(tokenizer))
        if self.config.lora_config is not None:
            from slotserve.lora.peft_format import AdapterChecker

            self.processor.lora_checker = AdapterChecker(
                model_config, self.config.lora_config.max_lora_rank)
        # The last failure inside the model's forward pass (its requests ended "error").
        self.last_error: BaseException | None = None
        # The Processor's prompt bound walked the whole vocabulary (a 262k-entry dict for
        # Gemma): ~50 MB that glibc keeps in the heap unless asked to give it back.
        trim_heap()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, *,
                         mode: EngineMode = "inproc", threads: int | None = None,
                         **kwargs: Any) -> LLMEngine:
        """Load the front's tokenizer and start the core where `mode` says (`threads`: the
        CPU threads of its forward pass; None: the default); the model's config is the one the core read with
        the weights (EngineConfig.model_config), in every mode."""
        if engine_args is None:
            engine_args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineArgs or keyword arguments, not both")
        path = engine_args.model_path()
        tokenizer_path = engine_args.tokenizer or path
        if mode != "process":
            # In one process the front loads first: importing transformers on a thread while
            # the core imports llguidance (which reads transformers' attributes) races.
            tokenizer = load_tokenizer(tokenizer_path)
            client = make_client(mode, engine_args, threads=threads)
            return cls(client, tokenizer, _core_model_config(client))
        # The front loads its tokenizer on a thread while the child starts the core: it takes
        # seconds for a large vocabulary (a GGUF file's is built from its metadata).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            front = pool.submit(load_tokenizer, tokenizer_path)
            client = make_client(mode, engine_args, threads=threads)
        try:
            tokenizer = front.result()
        except BaseException:
            client.shutdown()
            raise
        return cls(client, tokenizer, _core_model_config(client))

    # ----- requests -------------------------------------------------------------------------

    def process_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
        priority: int = 0, resumable: bool = False, arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize without submitting (raises RequestValidationError)."""
        existing = self.output_processor.groups.get(request_id)
        later_chunk = None
        if existing is not None:
            if not existing.resumable:
                raise RequestValidationError(f"request id {request_id!r} is already in use",
                                             "request_id")
            if existing.ended:
                raise RequestValidationError(
                    f"session {request_id!r} has ended: no input is taken after its end",
                    "request_id")
            # Whether the session can hold it is decided by the core, which knows its exact
            # length: a chunk that does not fit is refused there, as that chunk.
            later_chunk = 0
            check_session_chunk(existing.structured_outputs, params)
        return self.processor.process(
            request_id, prompt, params, priority=priority, resumable=resumable,
            arrival_time=arrival_time, output_kind=output_kind, continuation_of=later_chunk,
            lora_request=lora_request)

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Submit a processed request, or a session's next chunk (numbered here)."""
        self.output_processor.number(processed)
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
        lora_request: LoRARequest | None = None,
    ) -> None:
        session = self.output_processor.get_session(request_id)
        if session is not None and not resumable:
            if session.ended:
                raise RequestValidationError(f"session {request_id!r} has already ended",
                                             "request_id")
            self._end_session(request_id, priority)
            return
        self.add_processed_request(self.process_request(
            request_id, prompt, params, priority=priority, resumable=resumable,
            arrival_time=arrival_time, output_kind=output_kind, lora_request=lora_request))

    def _end_session(self, request_id: str, priority: int) -> None:
        # A non-resumable request with a session's id only marks its end; its prompt is
        # never run, so it skips the context-length checks (the session may be full).
        params = SamplingParams()
        mark = EngineCoreRequest(request_id, [], params, None, time.monotonic(), priority,
                                 continues_session=True)
        self.add_processed_request(ProcessedRequest(
            request_id, None, [], params, [mark], RequestOutputKind.CUMULATIVE,
            resumable=False))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    # ----- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        return self.process_outputs(self.engine_core.get_output())

    def process_outputs(self, outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """One batch from the core -> the RequestOutputs of the requests it changed."""
        if outputs.scheduled_new_req_ids:
            self.output_processor.mark_scheduled(outputs.scheduled_new_req_ids,
                                                 outputs.schedule_time)
        if outputs.step_error is not None:
            self.last_error = outputs.step_error
        request_outputs, stopped = self.output_processor.process_outputs(outputs.outputs,
                                                                         outputs.timestamp)
        if stopped:
            # Stop strings are found here, above the core: end those requests there (abort
            # semantics release their blocks and slot); callers see finish_reason "stop".
            self.engine_core.abort_requests(stopped)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: a caller's request not finished, or (with the core in
        this thread) a release the core still has to hand to the worker."""
        return (self.output_processor.has_unfinished_requests()
                or self.engine_core.needs_step())

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests).result()

    def get_stats(self) -> EngineStats:
        return self.with_front_counters(self.engine_core.get_stats().result())

    def with_front_counters(self, stats: EngineStats) -> EngineStats:
        """The core's stats with the token counters only the front knows."""
        return dataclasses.replace(
            stats, prompt_tokens_total=self.output_processor.num_prompt_tokens_total,
            generation_tokens_total=self.output_processor.num_generation_tokens_total)
