"""Turns a caller's prompt and SamplingParams into validated EngineCoreRequests.

Everything that can be wrong with a request is found here, before anything reaches the
scheduler, so a rejected request changes nothing in the engine.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from slotserve.checkpoint.chat_render import ChatRenderer
from slotserve.checkpoint.tokenizer import backend_tokenizer
from slotserve.core.request import validate_token_ids
from slotserve.engine.messages import EngineCoreRequest
from slotserve.errors import RequestValidationError
from slotserve.lora.request import LoRAAdapterError, LoRARequest
from slotserve.outputs import RequestOutputKind
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
                        template_kwargs: dict[str, Any] | None = None,
                        encode: Callable[[str], list[int]] | None = None,
                        render: Callable[..., str] | None = None) -> dict[str, Any]:
    """A conversation -> a prompt dict (text and token ids) through the chat template.
    `encode` tokenizes the text without special tokens (Processor.render_chat passes its
    own, which refuses text too long for the context before tokenizing it); `render` renders
    the template (Processor.render_chat: in a bounded child process, see
    slotserve.checkpoint.chat_render; else the tokenizer's apply_chat_template here)."""
    if isinstance(conversation, str) or not isinstance(conversation, Sequence) or not all(
            isinstance(m, Mapping) and "role" in m for m in conversation):
        raise RequestValidationError("a conversation is a list of {'role': ..., "
                                     "'content': ...} messages", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        chat_template = FALLBACK_CHAT_TEMPLATE
    if render is None:
        render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    try:
        text = render([dict(m) for m in conversation],
                      add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                      continue_final_message=continue_final_message, **(template_kwargs or {}))
    except RequestValidationError:
        raise
    except TemplateError as exc:  # the template rejected the messages (its own message)
        raise RequestValidationError(f"cannot apply the chat template: {exc}",
                                     "messages") from exc
    except Exception as exc:  # a template bug: its text is not the client's business
        logger.warning("the chat template failed: %s: %s", type(exc).__name__, exc)
        raise RequestValidationError("cannot apply the chat template to these messages",
                                     "messages") from exc
    # The template already writes any BOS; tokenizing with special tokens would double it.
    ids = (encode(text) if encode is not None
           else list(tokenizer.encode(text, add_special_tokens=False)))
    return {"prompt": text, "prompt_token_ids": ids}


def prompt_byte_bound(tokenizer: Any, max_model_len: int) -> int:
    """Bytes of text beyond which a prompt certainly has more than max_model_len tokens: no
    token spells more bytes than the longest vocabulary entry, and a normalizer shrinks text
    at most 4x (Unicode composition: three Hangul jamo become one syllable). Such text is
    refused before tokenizing it (a 7 MB prompt takes seconds and a GB to tokenize)."""
    backend = backend_tokenizer(tokenizer)
    longest = max((len(token.encode("utf-8", "surrogatepass"))
                   for token in backend.get_vocab(with_added_tokens=True)), default=1)
    slack = 1 if backend.normalizer is None else 4
    return max_model_len * longest * slack


# Client priorities are bounded (the priority policy compares them; nothing else may).
MAX_PRIORITY = 2**31 - 1


def _is_empty(prompt: object) -> bool:
    return isinstance(prompt, str | list | tuple) and len(prompt) == 0


class Processor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_ids: Sequence[int], *, priority_policy: bool = False) -> None:
        self.tokenizer = tokenizer
        # A max_tokens past the context is clipped to it; the server sets this False and
        # refuses such a request instead (as OpenAI does: never fewer tokens than asked for).
        self.clip_max_tokens = True
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Under FCFS a priority other than 0 is refused (as vLLM does): it would only let a
        # client decide whose idle session gives up its slot first.
        self.priority_policy = priority_policy
        # The first EOS id is "the" EOS (the sampler masks it under min_tokens); models with
        # several (Llama 3: <|end_of_text|>, <|eot_id|>) stop on the others as stop tokens.
        self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
        self.extra_stop_token_ids: list[int] = list(eos_token_ids[1:])

        self.max_prompt_bytes = prompt_byte_bound(tokenizer, max_model_len)
        self._backend = backend_tokenizer(tokenizer)
        # Chat templates render in bounded child processes, started on first use.
        self.chat_renderer = ChatRenderer(tokenizer)
        # Reads an adapter and checks it against the model (raises LoRAAdapterError); set by
        # LLMEngine when LoRA is on.
        self.lora_checker: Callable[[LoRARequest], None] | None = None

    def check_lora(self, lora_request: object) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise RequestValidationError("lora_request must be a LoRARequest", "lora_request")
        if self.lora_checker is None:
            raise RequestValidationError("LoRA adapters are not enabled (--enable-lora)",
                                         "lora_request")
        try:
            self.lora_checker(lora_request)
        except LoRAAdapterError as exc:
            raise RequestValidationError(str(exc), "lora_request") from exc

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text. Text too long for the context is refused before it is
        tokenized. The Rust tokenizer's batch call releases the GIL (its single-text call
        does not), so a tokenization on a worker thread never stalls an event loop, and it
        needs no lock (transformers' own encode may change the tokenizer's settings)."""
        self.check_text_size(text)
        return list(self._backend.encode_batch([text],
                                               add_special_tokens=add_special_tokens)[0].ids)

    def check_text_size(self, text: str) -> None:
        bound = self.max_prompt_bytes
        # Characters never outnumber UTF-8 bytes: most texts are decided without encoding.
        if len(text) <= bound // 4:
            return
        size = len(text) if len(text) > bound else len(text.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise RequestValidationError(
                f"the prompt has {size} bytes of text, more than max_model_len="
                f"{self.max_model_len} tokens can hold with this tokenizer (at most {bound} "
                "bytes)", "prompt")

    def render_chat(self, conversation: Conversation, add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """apply_chat_template with this processor's size check and tokenizer."""
        return apply_chat_template(
            self.tokenizer, conversation, add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            encode=lambda text: self.tokenize(text, add_special_tokens=False),
            render=self.chat_renderer.render)

    def tokenize_chunk(self, prompt: str | list[int], first: bool) -> list[int]:
        """A session chunk's tokens: only the session's first chunk starts with BOS and
        friends. The first chunk may not be empty (as no prompt may: a session starts with
        something to read); a later one may (a zero-token continuation: generate more)."""
        if first and _is_empty(prompt):
            raise RequestValidationError("the first chunk's prompt is empty", "prompt")
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special_tokens=first)
        return list(prompt)

    def resolve_prompt(self, prompt: PromptType, allow_empty: bool = False
                       ) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt. An empty one is refused before tokenization (its
        BOS alone would make it look like a prompt) unless `allow_empty` (a session's later
        chunk)."""
        mapping = isinstance(prompt, Mapping)
        text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
        ids = (prompt.get("prompt_token_ids") if isinstance(prompt, Mapping)
               else prompt if isinstance(prompt, list | tuple) else None)
        if not allow_empty and (_is_empty(ids) or (ids is None and _is_empty(text))):
            raise RequestValidationError("the prompt is empty", "prompt")
        if ids is not None or (isinstance(prompt, Mapping) and "prompt_token_ids" in prompt):
            return (text if mapping and isinstance(text, str) else None), validate_token_ids(ids)
        if isinstance(text, str):
            return text, self.tokenize(text)
        if mapping:
            raise RequestValidationError(
                "a prompt dict needs 'prompt_token_ids' (a list of ints) or 'prompt' (a string)",
                "prompt")
        raise RequestValidationError(
            f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
            "prompt")

    def check_priority(self, priority: object) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestValidationError("priority must be an integer", "priority")
        if priority and not self.priority_policy:
            raise RequestValidationError(
                "priority is only accepted when the server schedules by priority "
                "(--policy priority)", "priority")
        if abs(priority) > MAX_PRIORITY:
            raise RequestValidationError(
                f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}",
                "priority")

    def _fit_to_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """Token ids a request names must exist; a top_k past the vocabulary is no top_k."""
        vocab = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise RequestValidationError(
                    f"token id {bad} in {name} is out of range for a vocabulary of {vocab}",
                    name)
        if params.top_k >= vocab:
            return params.clone(top_k=0)
        return params

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
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and build the core Requests.

        `continuation_of` is not None for a streaming session's next chunk: the tokens the
        session holds as far as the caller knows, counted against max_model_len (the front
        passes 0: the core, which knows the exact length, refuses a chunk that does not fit).
        """
        if not isinstance(request_id, str) or not request_id:
            raise RequestValidationError("request_id must be a non-empty string", "request_id")
        if params is None:
            params = SamplingParams()
        self.check_priority(priority)
        if not isinstance(params, SamplingParams):
            raise RequestValidationError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                "sampling_params")
        text, token_ids = self.resolve_prompt(prompt, allow_empty=continuation_of is not None)
        if not token_ids and continuation_of is None:
            raise RequestValidationError("the prompt is empty", "prompt")
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                f"prompt token id {bad} is out of range for a vocabulary of {self.vocab_size}",
                "prompt_token_ids")
        params = self._fit_to_vocabulary(params)
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

        if lora_request is not None:
            self.check_lora(lora_request)
        grammar = None
        if params.structured_outputs is not None and continuation_of is None:
            # Built and checked here, so a bad constraint never reaches the core; a session's
            # grammar comes with its first chunk (LLMEngine checks the later ones).
            from slotserve.structured_output.grammar import checked_grammar

            grammar = checked_grammar(params.structured_outputs)
        if (not self.clip_max_tokens and not resumable and params.max_tokens is not None
                and params.max_tokens > room):
            raise RequestValidationError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens "
                f"exceed the model's context length of {self.max_model_len} tokens",
                "max_tokens", "context_length_exceeded")

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
                continues_session=continuation_of is not None, grammar=grammar,
                lora_request=lora_request))
        return ProcessedRequest(request_id, text, token_ids, params, requests, output_kind,
                                resumable)
