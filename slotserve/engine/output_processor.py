"""EngineCoreOutputs (token ids per core request) -> RequestOutputs (text, per caller request).

Holds the per-request state that only the front of the engine needs: detokenizers, logprobs,
timestamps, the n sequences of a request, and the chunk queue of streaming-input sessions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from slotserve.core.outputs import EngineCoreOutput, LogprobsEntry
from slotserve.core.sessions import kept_output_tokens
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.processor import ProcessedRequest
from slotserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from slotserve.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class SeqState:
    """One generated sequence: one core Request (one chunk of it, for a session)."""

    request_id: str
    index: int
    group: RequestGroup
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None
    # The core refused the request as invalid (CompletionOutput.rejected).
    rejected: bool = False
    finished: bool = False
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
                               self.stop_reason, self.finish_message, self.rejected)
        if kind is RequestOutputKind.DELTA:
            self.sent_tokens, self.sent_text = len(self.token_ids), len(text)
        return out


@dataclass(slots=True)
class RequestGroup:
    """A caller's request: its n sequences, or the current chunk of a streaming session."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    resumable: bool
    seqs: list[SeqState] = field(default_factory=list)
    num_unfinished: int = 0
    # Streaming sessions: idle between chunks; chunks (None = end of session) not yet begun.
    idle: bool = False
    queued: deque[ProcessedRequest | None] = field(default_factory=deque)
    # Tokens the session holds in the engine once the current chunk is folded in.
    session_num_tokens: int = 0
    # The constraint of the request (a session's: its first chunk's, for all chunks).
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def ended(self) -> bool:
        """The session's end was asked for: nothing more is taken (LLMEngine refuses it).
        An end mark is always the last thing queued (one that finds the session idle
        removes the group at once)."""
        return bool(self.queued) and self.queued[-1] is None


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
        self.seqs: dict[str, SeqState] = {}
        # Groups with work in the engine (not idle sessions, which wait for input by design).
        self._num_active = 0
        # Outputs produced outside a step (a session ended while idle), returned next step.
        self._pending_outputs: list[RequestOutput] = []
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ----- request lifetimes -----------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self._num_active > 0 or bool(self._pending_outputs)

    def get_session(self, request_id: str) -> RequestGroup | None:
        group = self.groups.get(request_id)
        return group if group is not None and group.resumable else None

    def add_request(self, processed: ProcessedRequest) -> None:
        group = self.groups.get(processed.request_id)
        if group is None:
            group = RequestGroup(processed.request_id, processed.prompt,
                                 processed.prompt_token_ids, processed.output_kind,
                                 processed.resumable,
                                 structured_outputs=processed.params.structured_outputs)
            self.groups[group.request_id] = group
            self._num_active += 1
            self._start_chunk(group, processed)
            return
        # The next chunk of a session, or (non-resumable) the end-of-session mark.
        item = processed if processed.resumable else None
        if group.idle:
            self._resume(group, item)
        else:
            group.queued.append(item)

    def _start_chunk(self, group: RequestGroup, processed: ProcessedRequest) -> None:
        for seq in group.seqs:
            self.seqs.pop(seq.request_id, None)
        group.prompt = processed.prompt
        group.prompt_token_ids = processed.prompt_token_ids
        group.session_num_tokens += len(processed.prompt_token_ids)
        group.seqs = []
        params = processed.params
        for index, request in enumerate(processed.requests):
            seq = SeqState(
                request.request_id, index, group,
                IncrementalDetokenizer(self._tokenizer, processed.prompt_token_ids, params),
                RequestMetrics(arrival_time=request.arrival_time,
                               num_prompt_tokens=len(processed.prompt_token_ids)),
                want_logprobs=params.logprobs is not None,
            )
            if seq.want_logprobs:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            group.seqs.append(seq)
            self.seqs[seq.request_id] = seq
        group.num_unfinished = len(group.seqs)

    def _resume(self, group: RequestGroup, item: ProcessedRequest | None) -> None:
        if item is None:
            # Ended while idle: the scheduler aborts it; the caller sees it finish now.
            self._remove(group)
            out = self._make_output(group, True, force=True)
            assert out is not None
            self._pending_outputs.append(out)
            return
        group.idle = False
        self._num_active += 1
        self._start_chunk(group, item)

    def _remove(self, group: RequestGroup) -> None:
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
        for seq in group.seqs:
            if self.seqs.get(seq.request_id) is seq:
                del self.seqs[seq.request_id]
        if not group.idle:
            self._num_active -= 1

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the given caller requests; returns the core request ids to abort."""
        core_ids: list[str] = []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            core_ids.extend(s.request_id for s in group.seqs if not s.finished)
            self._remove(group)
        return core_ids

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            seq = self.seqs.get(rid)
            if seq is not None and seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    # ----- per step -------------------------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs of this step and the core ids whose stop string matched
        (the caller aborts those in the engine core)."""
        request_outputs, self._pending_outputs = self._pending_outputs, []
        to_abort: list[str] = []
        changed: dict[str, RequestGroup] = {}
        for out in outputs:
            seq = self.seqs.get(out.request_id)
            if seq is None or seq.finished:
                continue  # aborted by the caller while the step ran
            group = seq.group
            if group.idle:
                if out.finished:  # the engine ended an idle session (timeout)
                    request_outputs.append(self._end_idle(group, out, now))
                continue
            changed[group.request_id] = group
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
                if out.finished or not group.resumable:
                    self._finish_seq(seq, now)
                else:
                    seq.detokenizer.flush()
                    seq.metrics.finished_time = now
        for group in changed.values():
            done = group.num_unfinished == 0
            boundary = not done and group.resumable and group.seqs[0].finish_reason is not None
            request_output = self._make_output(group, done, force=boundary)
            if request_output is not None:
                request_outputs.append(request_output)
            if done:
                self._remove(group)
            elif boundary:
                self._chunk_boundary(group)
        return request_outputs, to_abort

    def _end_idle(self, group: RequestGroup, out: EngineCoreOutput, now: float) -> RequestOutput:
        seq = group.seqs[0]
        seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        seq.finish_message = out.finish_message
        seq.finished = True
        seq.metrics.finished_time = now
        self._remove(group)
        final = self._make_output(group, True, force=True)
        assert final is not None
        return final

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
        seq.group.num_unfinished -= 1

    def _chunk_boundary(self, group: RequestGroup) -> None:
        """A session's chunk stopped: it goes idle, or starts its next queued chunk."""
        group.session_num_tokens += kept_output_tokens(len(group.seqs[0].token_ids))
        group.idle = True
        self._num_active -= 1
        if group.queued:
            self._resume(group, group.queued.popleft())

    def _make_output(self, group: RequestGroup, finished: bool, *,
                     force: bool = False) -> RequestOutput | None:
        kind = group.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not (finished or force):
            return None
        seqs = group.seqs
        metrics = seqs[0].metrics if len(seqs) == 1 else _merge_metrics(seqs)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[s.completion(kind) for s in seqs],
            finished=finished,
            num_cached_tokens=max(s.num_cached_tokens for s in seqs),
            metrics=metrics,
        )
