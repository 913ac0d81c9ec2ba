"""Pydantic models of the OpenAI-compatible API: requests (validated strictly) and responses.

Requests are validated in strict mode so that `"max_tokens": "5"` or `"n": true` is a 400, not a
silent coercion. Unknown fields are ignored, as the OpenAI API does; the extra sampling fields
that `extra_body` sends (`top_k`, `min_p`, ...) are declared here so they reach the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotserve.entrypoints.openai.protocol_structured import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolChoice,
)
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIBaseModel):
    """The sampling fields shared by completions, chat and session chunks."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extra fields, sent by clients through `extra_body` (names as in vLLM).
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's: token id (a JSON object key, so a string) -> bias added to its logit.
    logit_bias: dict[str, float] | None = None
    # Structured outputs: vLLM's extra field, or OpenAI's response_format (one or the other).
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # SamplingParams validates every range and raises RequestValidationError naming the
        # field, which the server maps to a 400.
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_token_keys(self.logit_bias),
            structured_outputs=(self.structured_outputs.to_params()
                                if self.structured_outputs is not None else None),
        )


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:  # before converting a huge map
        raise RequestValidationError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got "
                                     f"{len(bias)}", "logit_bias")
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise RequestValidationError("logit_bias keys must be token ids", "logit_bias") from None


# ---------------------------------------------------------------------------- completions

PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    model: str | None = None
    prompt: PromptType
    max_tokens: int | None = 16
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    user: str | None = None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat

class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # An assistant turn's calls, sent back with the tools' results ("tool" messages).
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    user: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, num_logprobs)


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- misc endpoints

class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "slotserve"
    root: str | None = None
    # An adapter's base model (vLLM's field); None for the base.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---------------------------------------------------------------------------- sessions

class SessionChunk(_SamplingFields):
    """One input chunk of a streaming-input session (a WebSocket message of type "input")."""

    type: Literal["input"] = "input"
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # Who the session is for admission control (the first chunk's; else the peer address).
    user: str | None = None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs)
