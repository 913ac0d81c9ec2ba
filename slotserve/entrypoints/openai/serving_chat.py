"""POST /v1/chat/completions: the tokenizer's chat template, then the same engine path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from slotserve.core.outputs import LogprobsEntry
from slotserve.engine.processor import ProcessedRequest, Processor
from slotserve.entrypoints.openai.errors import APIError, bad_request
from slotserve.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    random_uuid,
)
from slotserve.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    Outputs,
    merge_generators,
    sse,
)
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutput


def render_chat(processor: Processor, messages: list[ChatMessage], *,
                add_generation_prompt: bool, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template (call it off the
    event loop: templating and tokenization take time)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
        raise bad_request("continue_final_message needs add_generation_prompt=false and a "
                          "final assistant message", "continue_final_message")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        prompt = processor.render_chat(conversation, add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       template_kwargs=template_kwargs)
    except RequestValidationError as exc:
        raise bad_request(exc.message, exc.param) from exc
    return prompt["prompt_token_ids"]


def _chat_param_names(req: ChatCompletionRequest,
                      exc: RequestValidationError | APIError) -> APIError:
    """Name the field the chat client actually sent (the engine knows only its own names)."""
    err = exc if isinstance(exc, APIError) else bad_request(exc.message, exc.param)
    if err.param == "logprobs":
        err.param = "top_logprobs"
    elif err.param == "max_tokens" and req.max_completion_tokens is not None:
        err.param = "max_completion_tokens"
    elif err.param == "prompt":  # the prompt is the rendered messages
        err.param = "messages"
    return err


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        request_id = f"chatcmpl-{random_uuid()}"
        await self.precheck(raw, req.user)

        def prepare() -> ProcessedRequest:
            try:
                params = req.to_sampling_params(req.requested_max_tokens())
                prompt_ids = render_chat(self.engine.processor, req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         template_kwargs=req.chat_template_kwargs)
                return self.prepare(prompt_ids, params, request_id, req.priority)
            except (RequestValidationError, APIError) as exc:
                raise _chat_param_names(req, exc) from exc

        # Templating and tokenization happen off the event loop; then the request waits
        # for its turn.
        processed = await self.engine.run_off_loop(prepare)
        ticket = await self.admit(raw, req.user, [processed])
        outputs = merge_generators([self.engine.generate(processed)])
        return await self.respond_admitted(raw, req, processed, request_id, model, ticket,
                                           outputs)

    def _logprobs(self, token_ids: list[int], entries: list[LogprobsEntry] | None,
                  num_top: int) -> ChatChoiceLogProbs:
        content = []
        for token_id, entry in zip(token_ids, entries or [], strict=False):
            token = self.token_text(token_id)
            top = [ChatLogProb(token=self.token_text(t), logprob=lp,
                               bytes=list(self.token_text(t).encode()))
                   for t, lp in self.top_entries(entry, num_top)]
            content.append(ChatLogProbsContent(
                token=token, logprob=entry.get(token_id, float("-inf")),
                bytes=list(token.encode()), top_logprobs=top))
        return ChatChoiceLogProbs(content=content)

    async def _collect(self, req: ChatCompletionRequest, processed: ProcessedRequest,
                       request_id: str, created: int, model: str,
                       outputs: Outputs
                       ) -> ChatCompletionResponse:
        states = [ChoiceState() for _ in range(req.n)]
        cached = 0
        async for _, out in outputs:
            cached = out.num_cached_tokens
            for c in out.outputs:
                states[c.index].add(c, keep=True)
        choices = [ChatCompletionResponseChoice(
            index=k, message=ChatResponseMessage(content="".join(st.text_parts)),
            logprobs=(self._logprobs(st.token_ids, st.logprobs, req.top_logprobs or 0)
                      if req.logprobs else None),
            finish_reason=st.finish_reason, stop_reason=st.stop_reason)
            for k, st in enumerate(states)]
        usage = self.usage(len(processed.prompt_token_ids),
                           sum(st.num_tokens for st in states), cached)
        return ChatCompletionResponse(id=request_id, created=created, model=model,
                                      choices=choices, usage=usage)

    def _frames(self, req: ChatCompletionRequest, processed: ProcessedRequest,
                request_id: str, created: int, model: str,
                first: tuple[int, RequestOutput],
                rest: Outputs) -> AsyncIterator[str]:
        states = [ChoiceState() for _ in range(req.n)]
        num_prompt = len(processed.prompt_token_ids)
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts is not None and opts.continuous_usage_stats
        cached = 0

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=choices)
            if continuous:
                body.usage = self.usage(num_prompt, sum(s.num_tokens for s in states), cached)
            return sse(body)

        def frames_for(_: int, out: RequestOutput) -> list[str]:
            nonlocal cached
            cached = out.num_cached_tokens
            frames = []
            for c in out.outputs:
                st = states[c.index]
                st.add(c, keep=False)
                finish = None
                if st.finish_reason is not None and not st.finish_sent:
                    st.finish_sent = True
                    finish = st.finish_reason
                if not c.text and finish is None and not (req.logprobs and c.token_ids):
                    continue
                logprobs = (self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                            if req.logprobs else None)
                frames.append(chunk([ChatCompletionResponseStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text or None),
                    logprobs=logprobs, finish_reason=finish,
                    stop_reason=st.stop_reason if finish else None)]))
            return frames

        def usage() -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=self.usage(num_prompt, sum(s.num_tokens for s in states),
                                 cached))) if include_usage else ""

        # OpenAI opens each choice with the assistant role and empty content.
        opening = [chunk([ChatCompletionResponseStreamChoice(
            index=k, delta=DeltaMessage(role="assistant", content=""))]) for k in range(req.n)]
        return self.sse_frames(opening, first, rest, frames_for, usage)
