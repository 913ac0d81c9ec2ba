"""POST /v1/chat/completions: the tokenizer's chat template, then the same engine path."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from slotserve.core.outputs import LogprobsEntry
from slotserve.engine.processor import ProcessedRequest, Processor
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.admission import AdmissionController, tag_client
from slotserve.entrypoints.openai.errors import APIError, bad_request, from_exception
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
from slotserve.entrypoints.openai.protocol_structured import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from slotserve.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    Outputs,
    merge_generators,
    sse,
)
from slotserve.entrypoints.openai.structured import (
    ToolContext,
    on_grammar_thread,
    rename_param,
    response_constraint,
    tool_context,
)
from slotserve.entrypoints.openai.tool_calls import ToolCallDelta, ToolCallParser, detect_format
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutput
from slotserve.sampling_params import StructuredOutputsParams
from slotserve.structured_output.grammar import checked_grammar


def template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it: tool calls with their arguments as objects
    (templates write them with tojson), tool results with their call's id."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for k, call in enumerate(m.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as exc:
                raise bad_request(f"the arguments of a tool call are not JSON: {exc}",
                                  f"messages.{index}.tool_calls.{k}.function.arguments"
                                  ) from exc
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        message["tool_calls"] = calls
    return message


def render_chat(processor: Processor, messages: list[ChatMessage], *,
                add_generation_prompt: bool, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template (call it off the
    event loop: templating and tokenization take time); `tools` go to the template too."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
        raise bad_request("continue_final_message needs add_generation_prompt=false and a "
                          "final assistant message", "continue_final_message")
    conversation = [template_message(m, i) for i, m in enumerate(messages)]
    if tools:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    prompt = processor.render_chat(conversation, add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   template_kwargs=template_kwargs)
    return list(prompt["prompt_token_ids"])


# The prompt ids a caller in process already rendered from this request's messages (the Ray
# ingress renders once; its replica's app must not again). Never set from the network.
PROMPT_IDS_SCOPE_KEY = "slotserve.prompt_token_ids"


def render_request(processor: Processor, req: ChatCompletionRequest) -> list[int]:
    """A chat request's prompt ids: its messages, tools and template options rendered."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return render_chat(processor, req.messages, add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message,
                       template_kwargs=req.chat_template_kwargs, tools=tools)


def _chat_param_names(req: ChatCompletionRequest, err: APIError) -> APIError:
    """Name the field the chat client actually sent (the engine knows only its own names)."""
    if err.param == "logprobs":
        err.param = "top_logprobs"
    elif err.param == "max_tokens" and req.max_completion_tokens is not None:
        err.param = "max_completion_tokens"
    elif err.param == "prompt":  # the prompt is the rendered messages
        err.param = "messages"
    return err


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 admission: AdmissionController | None = None,
                 tool_call_parser: str | None = None) -> None:
        super().__init__(engine, served_model_names, admission)
        # How this model writes tool calls: the flag's format, else its chat template's.
        tokenizer = engine.tokenizer
        self.tool_format = detect_format(getattr(tokenizer, "chat_template", None),
                                         tool_call_parser, tokenizer.get_added_vocab())
        # A template that cannot render a small conversation within the bounds is refused
        # now, not on each client's request.
        engine.processor.chat_renderer.probe()

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        request_id = f"chatcmpl-{random_uuid()}"
        await self.precheck(raw, req.user)

        def constrain() -> tuple[ToolContext | None, StructuredOutputsParams | None]:
            try:
                tools = tool_context(req.tools, req.tool_choice, req.parallel_tool_calls,
                                     self.tool_format)
                constraint = response_constraint(req.response_format, req.structured_outputs)
                if tools is not None and tools.constraint is not None:
                    if constraint is not None:
                        raise bad_request("response_format and structured_outputs cannot be "
                                          "combined with tool calls (tool_choice 'auto', "
                                          "'required' or a function)", "response_format")
                    constraint = tools.constraint
                if constraint is not None:
                    checked_grammar(constraint)
                return tools, constraint
            except (RequestValidationError, APIError) as exc:
                raise rename_param(_chat_param_names(req, from_exception(exc)),
                                   req.response_format) from exc

        # Tools and constraints are checked on the grammar-check thread (a large schema
        # takes a while), apart from the threads that template and tokenize.
        if req.tools or req.response_format is not None or req.structured_outputs is not None:
            tools, constraint = await on_grammar_thread(constrain, self.client_of(raw, req.user))
        else:
            tools, constraint = constrain()

        def prepare() -> ProcessedRequest:
            try:
                params = req.to_sampling_params(req.requested_max_tokens())
                if constraint is not None:
                    params = params.clone(structured_outputs=constraint)
                prompt_ids = raw.scope.get(PROMPT_IDS_SCOPE_KEY)
                if prompt_ids is None:
                    prompt_ids = render_request(self.engine.processor, req)
                return self.prepare(prompt_ids, params, request_id, req.priority, model)
            except (RequestValidationError, APIError) as exc:
                raise rename_param(_chat_param_names(req, from_exception(exc)),
                                   req.response_format) from exc

        # Templating and tokenization happen off the event loop; then the request waits
        # for its turn.
        processed = await self.engine.run_chat_off_loop(prepare)
        tag_client([processed], self.client_of(raw, req.user))
        ticket = await self.admit(raw, req.user, [processed])
        outputs = merge_generators([self.engine.generate(processed)])
        return await self.respond_admitted(raw, req, (processed, tools), request_id, model,
                                           ticket, outputs)

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

    async def _collect(self, req: ChatCompletionRequest,
                       request: tuple[ProcessedRequest, ToolContext | None],
                       request_id: str, created: int, model: str,
                       outputs: Outputs
                       ) -> ChatCompletionResponse:
        processed, tools = request
        states = [ChoiceState() for _ in range(req.n)]
        cached = 0
        async for _, out in outputs:
            cached = out.num_cached_tokens
            for c in out.outputs:
                states[c.index].add(c, keep=True)
        choices = []
        for k, st in enumerate(states):
            message, finish = _reply(tools, "".join(st.text_parts), st.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=k, message=message,
                logprobs=(self._logprobs(st.token_ids, st.logprobs, req.top_logprobs or 0)
                          if req.logprobs else None),
                finish_reason=finish, stop_reason=st.stop_reason))
        usage = self.usage(len(processed.prompt_token_ids),
                           sum(st.num_tokens for st in states), cached)
        return ChatCompletionResponse(id=request_id, created=created, model=model,
                                      choices=choices, usage=usage)

    def _frames(self, req: ChatCompletionRequest,
                request: tuple[ProcessedRequest, ToolContext | None],
                request_id: str, created: int, model: str,
                first: tuple[int, RequestOutput],
                rest: Outputs) -> AsyncIterator[str]:
        processed, tools = request
        states = [ChoiceState() for _ in range(req.n)]
        parsers = [tools.parser() if tools is not None else None for _ in range(req.n)]
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
                delta = DeltaMessage(content=c.text or None)
                parser = parsers[c.index]
                if parser is not None:
                    parsed = parser.feed(c.text)
                    if finish is not None:
                        tail = parser.finish()
                        parsed.content += tail.content
                        if finish == "stop" and parser.complete_calls:
                            finish = "tool_calls"
                    delta = DeltaMessage(content=parsed.content or None,
                                         tool_calls=_delta_calls(parser, parsed) or None)
                if (delta.content is None and delta.tool_calls is None and finish is None
                        and not (req.logprobs and c.token_ids)):
                    continue
                logprobs = (self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                            if req.logprobs else None)
                frames.append(chunk([ChatCompletionResponseStreamChoice(
                    index=c.index, delta=delta,
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


def _reply(tools: ToolContext | None, text: str,
           finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
    """The message of a whole reply, and its finish reason ("tool_calls" when it made calls
    and the grammar completed)."""
    parser = tools.parser() if tools is not None else None
    if parser is None:
        return ChatResponseMessage(content=text), finish_reason
    parser.feed(text)
    parser.finish()
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parser.complete_calls]
    # A call that max_tokens cut short (finish_reason "length") is dropped: it would not
    # parse as a call, and the tool-call markup never appears in the content. (Streamed, its
    # pieces went out as what they are: deltas of a call that never completed.)
    text = parser.content
    content = None if calls and not text.strip() else text
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatResponseMessage(content=content, tool_calls=calls), finish_reason


def _delta_calls(parser: ToolCallParser, parsed: ToolCallDelta) -> list[DeltaToolCall]:
    """OpenAI's streamed tool calls: the first delta of a call has its id and name, the
    following ones pieces of its arguments."""
    out = []
    for index in sorted(set(parsed.started) | set(parsed.arguments)):
        arguments = parsed.arguments.get(index)
        if index in parsed.started:
            out.append(DeltaToolCall(index=index, id=parser.calls[index].id, type="function",
                                     function=DeltaFunctionCall(name=parsed.started[index],
                                                                arguments=arguments or "")))
        elif arguments:
            out.append(DeltaToolCall(index=index,
                                     function=DeltaFunctionCall(arguments=arguments)))
    return out
