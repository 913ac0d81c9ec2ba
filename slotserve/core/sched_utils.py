"""Stop conditions and the streaming-session chunk fold, kept apart from the step loop."""

from __future__ import annotations

from slotserve.core.request import Request, RequestStatus, StreamingUpdate


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the last appended token ends the request; sets status and stop_reason.

    Below min_tokens neither EOS nor a stop token ends it (vLLM 0.33 lets them through and
    relies on the sampler; we enforce it here too), but the length caps still apply.
    """
    n_out = request.num_output_tokens
    params = request.sampling_params
    if n_out >= params.min_tokens:
        last = request.all_token_ids[-1]
        if last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        stop_ids = params.stop_token_ids
        if stop_ids and last in stop_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_tokens >= max_model_len or (
            request.max_tokens is not None and n_out >= request.max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def fold_session_chunk(request: Request, update: StreamingUpdate) -> None:
    """Apply the next input chunk to a stopped session.

    The outputs become part of the prompt, except the last sampled token, which was never fed
    through the model; then the chunk is appended and its sampling params take over.
    Dropping exactly that one token (rather than everything past num_computed_tokens) keeps
    the history intact when the session's KV was reclaimed and num_computed_tokens is 0.
    """
    tokens = request._all_token_ids
    if request._output_token_ids:
        tokens.pop()
    tokens.extend(update.prompt_token_ids)
    request._output_token_ids = []
    request.prompt_token_ids = list(tokens)
    # Computed KV beyond the kept tokens is stale; a zero-token continuation recomputes the
    # last kept token so that the step has something to sample from.
    request.num_computed_tokens = min(request.num_computed_tokens, len(tokens) - 1)
    request.sampling_params = update.sampling_params
    request.max_tokens = update.sampling_params.max_tokens
    request.eos_token_id = update.eos_token_id
    request.arrival_time = update.arrival_time
    request.priority = update.priority
    request.stop_reason = None
    request.status = RequestStatus.WAITING
