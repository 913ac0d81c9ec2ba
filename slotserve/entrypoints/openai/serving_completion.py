"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from slotserve.core.outputs import LogprobsEntry
from slotserve.engine.processor import ProcessedRequest
from slotserve.entrypoints.openai.admission import tag_client
from slotserve.entrypoints.openai.errors import APIError, bad_request, from_exception
from slotserve.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    random_uuid,
)
from slotserve.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    Outputs,
    check_prompt_count,
    check_sequence_count,
    merge_generators,
    sse,
)
from slotserve.entrypoints.openai.structured import (
    check_constraint,
    rename_param,
    response_constraint,
)
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutput


def normalize_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                      ) -> list[str | list[int]]:
    """The four prompt shapes of the API as a list of single prompts."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # type: ignore[list-item]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("the prompt is empty", "prompt")
    check_prompt_count(len(prompts))
    return prompts


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it must equal n)", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        prompts = normalize_prompts(req.prompt)
        check_sequence_count(len(prompts), req.n)
        await self.precheck(raw, req.user)
        params = req.to_sampling_params(req.max_tokens)
        constraint = response_constraint(req.response_format, req.structured_outputs)
        request_id = f"cmpl-{random_uuid()}"
        if constraint is not None:
            await check_constraint(constraint, req.response_format,
                                   self.client_of(raw, req.user))

        def prepare_all() -> list[ProcessedRequest]:
            try:
                constrained = (params.clone(structured_outputs=constraint)
                               if constraint is not None else params)
                return [self.prepare(p, constrained, f"{request_id}-{i}", req.priority, model)
                        for i, p in enumerate(prompts)]
            except (RequestValidationError, APIError) as exc:
                raise rename_param(from_exception(exc), req.response_format) from exc

        # Tokenization happens off the event loop; then the request waits for its turn.
        processed = await self.engine.run_off_loop(prepare_all)
        tag_client(processed, self.client_of(raw, req.user))
        ticket = await self.admit(raw, req.user, processed)
        outputs = merge_generators([self.engine.generate(p) for p in processed])
        return await self.respond_admitted(raw, req, processed, request_id, model, ticket,
                                           outputs)

    def _prompt_text(self, p: ProcessedRequest) -> str:
        """What echo repeats: the prompt's text, or its tokens' when it came as token ids."""
        return p.prompt if p.prompt is not None else self.engine.detokenize(p.prompt_token_ids)

    def _logprobs(self, token_ids: list[int], entries: list[LogprobsEntry] | None,
                  num_top: int, text_offset: int) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token_id, entry in zip(token_ids, entries or [], strict=False):
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.get(token_id))
            out.top_logprobs.append({self.token_text(t): lp
                                     for t, lp in self.top_entries(entry, num_top)})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    async def _collect(self, req: CompletionRequest, processed: list[ProcessedRequest],
                       request_id: str, created: int, model: str,
                       outputs: Outputs) -> CompletionResponse:
        n = req.n
        states = [ChoiceState() for _ in range(len(processed) * n)]
        cached = [0] * len(processed)
        async for i, out in outputs:
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                states[i * n + c.index].add(c, keep=True)
        choices = []
        for k, st in enumerate(states):
            prefix = self._prompt_text(processed[k // n]) if req.echo else ""
            logprobs = (self._logprobs(st.token_ids, st.logprobs, req.logprobs, len(prefix))
                        if req.logprobs is not None else None)
            choices.append(CompletionResponseChoice(
                index=k, text=prefix + "".join(st.text_parts), logprobs=logprobs,
                finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        usage = self.usage(sum(len(p.prompt_token_ids) for p in processed),
                           sum(st.num_tokens for st in states), sum(cached))
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage)

    def _frames(self, req: CompletionRequest, processed: list[ProcessedRequest],
                request_id: str, created: int, model: str,
                first: tuple[int, RequestOutput],
                rest: Outputs) -> AsyncIterator[str]:
        n = req.n
        states = [ChoiceState() for _ in range(len(processed) * n)]
        cached = [0] * len(processed)
        num_prompt = sum(len(p.prompt_token_ids) for p in processed)
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts is not None and opts.continuous_usage_stats
        echoed: set[int] = set()

        def frames_for(i: int, out: RequestOutput) -> list[str]:
            cached[i] = out.num_cached_tokens
            frames = []
            for c in out.outputs:
                k = i * n + c.index
                st = states[k]
                st.add(c, keep=False)
                text = c.text
                if req.echo and k not in echoed:
                    echoed.add(k)
                    text = self._prompt_text(processed[i]) + text
                finish = None
                if st.finish_reason is not None and not st.finish_sent:
                    st.finish_sent = True
                    finish = st.finish_reason
                if not text and finish is None and not (req.logprobs is not None
                                                        and c.token_ids):
                    continue
                logprobs = (self._logprobs(c.token_ids, c.logprobs, req.logprobs, st.text_len)
                            if req.logprobs is not None else None)
                st.text_len += len(text)
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionResponseChoice(
                        index=k, text=text, logprobs=logprobs, finish_reason=finish,
                        stop_reason=st.stop_reason if finish else None)])
                if continuous:
                    chunk.usage = self.usage(num_prompt, sum(s.num_tokens for s in states),
                                             sum(cached))
                frames.append(sse(chunk))
            return frames

        def usage() -> str:
            return sse(CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=self.usage(num_prompt, sum(s.num_tokens for s in states),
                                 sum(cached)))) if include_usage else ""

        return self.sse_frames([], first, rest, frames_for, usage)
