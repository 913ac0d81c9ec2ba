"""Turns a caller's prompt and SamplingParams into validated EngineCoreRequests.

Everything that can be wrong with a request is found here, before anything reaches the
scheduler, so a rejected request changes nothing in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotserve.core.request import validate_token_ids
from slotserve.engine.messages import EngineCoreRequest
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutputKind
from slotserve.sampling_params import SamplingParams

# What callers may pass as a prompt: text, pre-tokenized ids, or a dict with either.
PromptType = str | Mapping[str, Any] | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class ProcessedRequest:
    """A caller's request, ready to submit: one core request per sequence (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    requests: list[EngineCoreRequest]
    output_kind: RequestOutputKind
    resumable: bool


def child_request_id(request_id: str, index: int) -> str:
    # vLLM's scheme for the sequences of an n > 1 request.
    return f"{index}_{request_id}"


# Used only when a tokenizer has no chat template of its own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def apply_chat_template(tokenizer: Any, conversation: Conversation,
                        add_generation_prompt: bool = True,
                        chat_template: str | None = None, *,
                        continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A conversation -> a prompt dict (text and token ids) through the chat template."""
    if isinstance(conversation, str) or not isinstance(conversation, Sequence) or not all(
            isinstance(m, Mapping) and "role" in m for m in conversation):
        raise RequestValidationError("a conversation is a list of {'role': ..., "
                                     "'content': ...} messages", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        chat_template = FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in conversation], tokenize=False,
            add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as exc:  # the template rejected the messages
        raise RequestValidationError(f"cannot apply the chat template: {exc}",
                                     "messages") from exc
    # The template already writes any BOS; tokenizing with special tokens would double it.
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return {"prompt": text, "prompt_token_ids": ids}


class Processor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The first EOS id is "the" EOS (the sampler masks it under min_tokens); models with
        # several (Llama 3: <|end_of_text|>, <|eot_id|>) stop on the others as stop tokens.
        self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
        self.extra_stop_token_ids: list[int] = list(eos_token_ids[1:])

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def tokenize_chunk(self, prompt: str | list[int], first: bool) -> list[int]:
        """A session chunk's tokens: only the session's first chunk starts with BOS and
        friends."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=first))
        return list(prompt)

    def resolve_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                ids = validate_token_ids(prompt["prompt_token_ids"], allow_empty=True)
                return (text if isinstance(text, str) else None), ids
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise RequestValidationError(
                "a prompt dict needs 'prompt_token_ids' (a list of ints) or 'prompt' (a string)",
                "prompt")
        if isinstance(prompt, list | tuple):
            return None, validate_token_ids(prompt, allow_empty=True)
        raise RequestValidationError(
            f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
            "prompt")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        *,
        priority: int = 0,
        resumable: bool = False,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        continuation_of: int | None = None,
    ) -> ProcessedRequest:
        """Validate and build the core Requests.

        `continuation_of` is the number of tokens a streaming session already holds when this
        is its next chunk (None for a new request); it counts against max_model_len.
        """
        if not isinstance(request_id, str) or not request_id:
            raise RequestValidationError("request_id must be a non-empty string", "request_id")
        if params is None:
            params = SamplingParams()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestValidationError("priority must be an integer", "priority")
        if not isinstance(params, SamplingParams):
            raise RequestValidationError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                "sampling_params")
        text, token_ids = self.resolve_prompt(prompt)
        if not token_ids and continuation_of is None:
            raise RequestValidationError("the prompt is empty", "prompt")
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                f"prompt token id {bad} is out of range for a vocabulary of {self.vocab_size}",
                "prompt_token_ids")
        if resumable and params.n != 1:
            raise RequestValidationError("streaming-input sessions support only n=1", "n")
        if resumable and params.stop_strings:
            raise RequestValidationError(
                "stop strings are not supported for streaming-input sessions", "stop")

        context_len = (continuation_of or 0) + len(token_ids)
        # The scheduler computes at most max_model_len - 1 tokens and every request must
        # sample at least one, so the prompt must leave room for one generated token.
        room = self.max_model_len - context_len
        if room < 1:
            what = "the session" if continuation_of else "the prompt"
            raise RequestValidationError(
                f"{what} has {context_len} tokens, but max_model_len is {self.max_model_len}; "
                f"at most {self.max_model_len - 1} leave room to generate", "prompt")
        if params.min_tokens > room:
            raise RequestValidationError(
                f"min_tokens={params.min_tokens} does not fit: the prompt leaves {room} tokens "
                f"of context (max_model_len {self.max_model_len})", "min_tokens")

        grammar = None
        if params.structured_outputs is not None and continuation_of is None:
            # Built and checked here, so a bad constraint never reaches the core; a session's
            # grammar comes with its first chunk (LLMEngine checks the later ones).
            from slotserve.structured_output import checked_grammar

            grammar = checked_grammar(params.structured_outputs)

        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_token_ids = params.stop_token_ids
        if self.extra_stop_token_ids and not params.ignore_eos:
            stop_token_ids = list(stop_token_ids or []) + [
                t for t in self.extra_stop_token_ids if t not in (stop_token_ids or [])]
        if arrival_time is None:
            arrival_time = time.monotonic()

        requests = []
        for index in range(params.n):
            changes: dict[str, object] = {}
            if max_tokens != params.max_tokens:
                changes["max_tokens"] = max_tokens
            if stop_token_ids is not params.stop_token_ids:
                changes["stop_token_ids"] = stop_token_ids
            if params.n > 1:
                changes["n"] = 1
                # Distinct but reproducible streams for the n sequences.
                if params.seed is not None:
                    changes["seed"] = params.seed + index
            child_params = params.clone(**changes) if changes else params
            child_id = request_id if params.n == 1 else child_request_id(request_id, index)
            eos = None if params.ignore_eos else self.eos_token_id
            requests.append(EngineCoreRequest(
                child_id, token_ids, child_params, eos, arrival_time, priority, resumable,
                continues_session=continuation_of is not None, grammar=grammar))
        return ProcessedRequest(request_id, text, token_ids, params, requests, output_kind,
                                resumable)
