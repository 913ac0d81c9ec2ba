"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from slotserve.engine.args import EngineArgs
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.messages import EngineStats
from slotserve.engine.processor import (
    Conversation,
    ProcessedRequest,
    PromptType,
    apply_chat_template,
)
from slotserve.errors import EngineDeadError, RequestValidationError
from slotserve.lora.request import LoRARequest
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams


class LLM:
    """An engine for offline batched generation.

    Keywords are the flat engine arguments of `EngineArgs` (as in vLLM): dtype, device,
    max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_blocks,
    kv_cache_memory, enable_prefix_caching, enable_chunked_prefill, policy, check, seed, ...
    `model` defaults to the bundled Shakespeare model.
    """

    def __init__(self, model: str | None = None, *, llm_engine: LLMEngine | None = None,
                 **engine_kwargs: Any) -> None:
        """Build an engine from the arguments, or wrap `llm_engine`, built elsewhere (tests
        put a fake model runner into one)."""
        if llm_engine is None:
            llm_engine = LLMEngine.from_engine_args(
                EngineArgs.from_kwargs(model=model, **engine_kwargs))
        elif model is not None or engine_kwargs:
            raise TypeError("pass either llm_engine or engine arguments, not both")
        self.llm_engine = llm_engine
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns the finished outputs in input order.
        `lora_request`: one adapter for every prompt, or one (or None: the base) per prompt.

        A prompt is a string or {"prompt_token_ids": [...]}. Every prompt is validated before
        any is submitted, so a RequestValidationError leaves the engine untouched.
        """
        if isinstance(prompts, str | Mapping):
            prompt_list: list[PromptType] = [prompts]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        return self._generate(prompt_list, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or
        to a list of conversations, through the tokenizer's chat template (or
        `chat_template`), rendered within the server's bounds: a ChatTemplateError
        (RequestValidationError, param "messages") past them."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise RequestValidationError("messages must be a non-empty list of messages "
                                         "or of conversations", "messages")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        # Rendered as the server renders them: in a child process bounded in time, memory
        # and output size (slotserve.checkpoint.chat_render), so a hostile template in a
        # model file cannot hang or exhaust this process either.
        processor = self.llm_engine.processor
        prompts: list[PromptType] = [
            apply_chat_template(self.llm_engine.tokenizer, conv,  # type: ignore[arg-type]
                                add_generation_prompt, chat_template,
                                encode=lambda text: processor.tokenize(
                                    text, add_special_tokens=False),
                                render=processor.chat_renderer.render)
            for conv in conversations]
        return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts: list[PromptType],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                  ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise RequestValidationError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts",
                    "sampling_params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise RequestValidationError(
                    f"got {len(loras)} lora_requests for {len(prompts)} prompts", "lora_request")
        engine = self.llm_engine
        processed: list[ProcessedRequest] = []
        for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras,
                                                       strict=True)):
            try:
                processed.append(engine.process_request(
                    str(next(self._counter)), prompt, params,
                    output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora))
            except RequestValidationError as exc:
                if len(prompts) == 1:
                    raise
                raise RequestValidationError(f"prompt {i}: {exc.message}", exc.param) from exc
        order = {p.request_id: i for i, p in enumerate(processed)}
        results: list[RequestOutput | None] = [None] * len(processed)
        try:
            for p in processed:
                engine.add_processed_request(p)
            self._run_engine(order, results, use_tqdm)
        finally:
            # On an error or Ctrl-C, leave nothing of this call behind in the engine.
            unfinished = [rid for rid, i in order.items() if results[i] is None]
            if unfinished:
                engine.abort_request(unfinished)
        return results  # type: ignore[return-value]

    def _run_engine(self, order: dict[str, int], results: list[RequestOutput | None],
                    use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        start, num_out = time.monotonic(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    index = order.get(out.request_id)
                    if index is None or not out.finished:
                        continue
                    results[index] = out
                    rejected = next((c for c in out.outputs if c.rejected), None)
                    if rejected is not None:
                        raise RequestValidationError(
                            f"prompt {index}: {rejected.finish_message}",
                            rejected.error_param or "structured_outputs", rejected.error_code)
                    if any(c.finish_reason == "error" for c in out.outputs):
                        raise EngineDeadError(
                            f"the model failed while running request {out.request_id}: "
                            f"{engine.last_error!r}") from engine.last_error
                    if bar is not None:
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        rate = num_out / max(time.monotonic() - start, 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
