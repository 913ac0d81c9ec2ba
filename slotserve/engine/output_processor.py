"""EngineCoreOutputs (token ids per core request) -> RequestOutputs (text, per caller request).

Holds the per-request state that only the front of the engine needs: detokenizers, logprobs,
timestamps, the n sequences of a request. A streaming-input session's chunks are numbered
when they are submitted, and each has its own state from then on, keyed by (request id,
chunk): the core says when a chunk ends and when the session does (EngineCoreOutput), so the
front keeps no copy of the session's state machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from slotserve.core.outputs import EngineCoreOutput, FinishReason, LogprobsEntry
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.processor import ProcessedRequest
from slotserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from slotserve.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class SeqState:
    """One generated sequence: one core Request, or one chunk of a session."""

    request_id: str
    index: int
    group: RequestGroup
    chunk: int
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None
    # The core refused the request (or this chunk) as invalid (CompletionOutput.rejected).
    rejected: bool = False
    error_code: str | None = None
    error_param: str | None = None
    finished: bool = False
    # A session's: why it ended (the core's session_end), once it has.
    session_end: FinishReason | None = None
    num_cached_tokens: int = 0
    # What DELTA outputs have already handed out.
    sent_tokens: int = 0
    sent_text: int = 0

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        done = self.finish_reason is not None
        text = self.detokenizer.visible_text(done)
        # DELTA: what was not handed out yet; otherwise everything (copies, from 0).
        sent_tokens, sent_text = ((self.sent_tokens, self.sent_text)
                                  if kind is RequestOutputKind.DELTA else (0, 0))
        logprobs = None if self.logprobs is None else self.logprobs[sent_tokens:]
        out = CompletionOutput(self.index, text[sent_text:], self.token_ids[sent_tokens:],
                               self.cumulative_logprob, logprobs, self.finish_reason,
                               self.stop_reason, self.finish_message, self.rejected,
                               self.error_code, self.error_param)
        if kind is RequestOutputKind.DELTA:
            self.sent_tokens, self.sent_text = len(self.token_ids), len(text)
        return out


@dataclass(slots=True)
class RequestGroup:
    """A caller's request and its n sequences, or a streaming session and the states of its
    submitted chunks that have not ended."""

    request_id: str
    output_kind: RequestOutputKind
    resumable: bool
    seqs: list[SeqState] = field(default_factory=list)
    num_unfinished: int = 0
    # The constraint of the request (a session's: its first chunk's, for all chunks).
    structured_outputs: StructuredOutputsParams | None = None
    # Sessions: the index the next chunk gets, the last chunk that ended (an end between
    # chunks reports with its prompt and metrics), and whether the end mark was sent (then
    # nothing more is taken: LLMEngine refuses it).
    next_chunk: int = 0
    last: SeqState | None = None
    ended: bool = False

    def constraint_param(self) -> str | None:
        """The field a refusal of this request names: the one its constraint came from."""
        return None if self.structured_outputs is None else self.structured_outputs.param


def _merge_metrics(seqs: list[SeqState]) -> RequestMetrics:
    """One RequestMetrics for an n > 1 request: earliest starts, latest ends, summed tokens."""
    ms = [s.metrics for s in seqs]

    def first(values: list[float | None]) -> float | None:
        return min((v for v in values if v is not None), default=None)

    def last(values: list[float | None]) -> float | None:
        return max((v for v in values if v is not None), default=None)

    finished = last([m.finished_time for m in ms]) if all(s.finished for s in seqs) else None
    return RequestMetrics(
        arrival_time=ms[0].arrival_time,
        first_scheduled_time=first([m.first_scheduled_time for m in ms]),
        first_token_time=first([m.first_token_time for m in ms]),
        last_token_time=last([m.last_token_time for m in ms]),
        finished_time=finished,
        num_prompt_tokens=ms[0].num_prompt_tokens,
        num_generation_tokens=sum(m.num_generation_tokens for m in ms),
        token_times=sorted(t for m in ms for t in m.token_times),
    )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        # The sequences (a session's: its submitted chunks) waiting for outputs, by (core
        # request id, chunk).
        self.seqs: dict[tuple[str, int], SeqState] = {}
        # Sessions whose end mark was sent and whose end has not come back yet.
        self._num_ending = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ----- request lifetimes -----------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        # Idle sessions wait for input by design: they hold no sequence here.
        return bool(self.seqs) or self._num_ending > 0

    def get_session(self, request_id: str) -> RequestGroup | None:
        group = self.groups.get(request_id)
        return group if group is not None and group.resumable else None

    def number(self, processed: ProcessedRequest) -> None:
        """Give a request its chunk index before it is submitted (0 but for a session's
        later chunk or end mark)."""
        group = self.groups.get(processed.request_id)
        chunk = 0 if group is None else group.next_chunk
        for request in processed.requests:
            request.chunk, request.continues_session = chunk, chunk > 0

    def add_request(self, processed: ProcessedRequest) -> None:
        """A submitted request, chunk or (a later one, not resumable) end-of-session mark."""
        group = self.groups.get(processed.request_id)
        if group is None:
            group = RequestGroup(processed.request_id, processed.output_kind,
                                 processed.resumable,
                                 structured_outputs=processed.params.structured_outputs)
            self.groups[group.request_id] = group
        group.next_chunk += 1
        if not processed.resumable and group.resumable:
            group.ended = True
            self._num_ending += 1
            return
        params = processed.params
        for index, request in enumerate(processed.requests):
            seq = SeqState(
                request.request_id, index, group, request.chunk, processed.prompt,
                processed.prompt_token_ids,
                IncrementalDetokenizer(self._tokenizer, processed.prompt_token_ids, params),
                RequestMetrics(arrival_time=request.arrival_time,
                               num_prompt_tokens=len(processed.prompt_token_ids)),
                want_logprobs=params.logprobs is not None,
            )
            if seq.want_logprobs:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            group.seqs.append(seq)
            self.seqs[seq.request_id, seq.chunk] = seq
        group.num_unfinished += len(processed.requests)

    def _remove(self, group: RequestGroup) -> None:
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
        for seq in group.seqs:
            self.seqs.pop((seq.request_id, seq.chunk), None)
        if group.ended:
            self._num_ending -= 1

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the given caller requests; returns the core request ids to abort."""
        core_ids: list[str] = []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            if group.resumable:
                core_ids.append(rid)  # idle or not, the session is over in the core too
            else:
                core_ids.extend(s.request_id for s in group.seqs if not s.finished)
            self._remove(group)
        return core_ids

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            seq = self.seqs.get((rid, 0))
            if seq is None:  # a session's later chunk: the first of those not ended
                group = self.groups.get(rid)
                seq = group.seqs[0] if group is not None and group.seqs else None
            if seq is not None and seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    # ----- per step -------------------------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs of this step and the core ids whose stop string matched
        (the caller aborts those in the engine core)."""
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        # In the order of the core's outputs: what changed, and sessions that ended between
        # their chunks (an end mark, an idle timeout), keyed by chunk -1.
        changed: dict[tuple[str, int], SeqState | EngineCoreOutput] = {}
        for out in outputs:
            seq = self.seqs.get((out.request_id, out.chunk))
            if seq is None:
                if out.session_end is not None and out.request_id in self.groups:
                    changed[out.request_id, -1] = out
                continue  # or aborted by the caller while the step ran
            group = seq.group
            changed[group.request_id, seq.chunk] = seq
            if out.new_token_ids:
                self._append_tokens(seq, out, now)
            if out.num_cached_tokens:
                seq.num_cached_tokens = out.num_cached_tokens
            if seq.finish_reason is not None:
                # A stop string matched; the engine still thinks the request runs.
                if not out.finished and out.finish_reason is None:
                    to_abort.append(seq.request_id)
                self._finish_seq(seq, now)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                seq.finish_message, seq.rejected = out.finish_message, out.rejected
                seq.error_code = out.error_code
                if out.rejected:
                    seq.error_param = group.constraint_param()
                self._finish_seq(seq, now)
            if out.finished and group.resumable:
                seq.session_end = out.session_end or FinishReason.ERROR
        for item in changed.values():
            if isinstance(item, EngineCoreOutput):
                request_outputs.append(self._end_between_chunks(item))
                continue
            seq = item
            group = seq.group
            if not group.resumable:
                done = group.num_unfinished == 0
                request_output = self._make_output(group, group.seqs, done)
                if done:
                    self._remove(group)
            else:
                request_output = self._make_output(group, [seq], seq.session_end is not None,
                                                   chunk_done=seq.finished)
                if seq.session_end is not None:
                    self._remove(group)
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs, to_abort

    def _end_between_chunks(self, out: EngineCoreOutput) -> RequestOutput:
        """The session's last output: nothing new, and why it ended."""
        group = self.groups[out.request_id]
        last = group.last
        self._remove(group)
        return RequestOutput(
            group.request_id, None if last is None else last.prompt,
            [] if last is None else last.prompt_token_ids,
            [CompletionOutput(0, "", [], None, None, out.finish_reason, out.stop_reason,
                              out.finish_message, out.rejected, out.error_code,
                              group.constraint_param() if out.rejected else None)],
            True, metrics=None if last is None else last.metrics, chunk=out.chunk,
            session_end=out.session_end)

    def _append_tokens(self, seq: SeqState, out: EngineCoreOutput, now: float) -> None:
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.num_prompt_tokens_total += m.num_prompt_tokens
        m.last_token_time = now
        m.token_times.append(now)
        n = len(out.new_token_ids)
        m.num_generation_tokens += n
        self.num_generation_tokens_total += n
        seq.token_ids.extend(out.new_token_ids)
        if seq.want_logprobs and out.new_logprobs:
            assert seq.logprobs is not None and seq.cumulative_logprob is not None
            for token_id, entry in zip(out.new_token_ids, out.new_logprobs, strict=False):
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry.get(token_id, 0.0)
        stop = seq.detokenizer.update(out.new_token_ids)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _finish_seq(self, seq: SeqState, now: float) -> None:
        seq.detokenizer.flush()
        seq.finished = True
        seq.metrics.finished_time = now
        group = seq.group
        group.num_unfinished -= 1
        del self.seqs[seq.request_id, seq.chunk]
        if group.resumable:  # the chunk ended: the session keeps only the chunks to come
            group.seqs.remove(seq)
            group.last = seq

    def _make_output(self, group: RequestGroup, seqs: list[SeqState], finished: bool, *,
                     chunk_done: bool = False) -> RequestOutput | None:
        kind = group.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not (finished or chunk_done):
            return None
        first = seqs[0]
        metrics = first.metrics if len(seqs) == 1 else _merge_metrics(seqs)
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[s.completion(kind) for s in seqs],
            finished=finished,
            num_cached_tokens=max(s.num_cached_tokens for s in seqs),
            metrics=metrics,
            chunk=first.chunk,
            chunk_done=chunk_done,
            session_end=first.session_end,
        )
