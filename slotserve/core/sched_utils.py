"""Stop conditions, kept apart from the step loop."""

from __future__ import annotations

from slotserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the last appended token ends the request; sets status and stop_reason.

    Below min_tokens neither EOS nor a stop token ends it (vLLM 0.33 lets them through and
    relies on the sampler; we enforce it here too), but the length caps still apply.
    """
    n_out = request.num_output_tokens
    params = request.sampling_params
    sor = request.structured_output_request
    if sor is not None and sor.grammar.is_terminated():
        # The grammar is complete (it allows only EOS now), also for a request that ignores
        # EOS; min_tokens cannot be combined with a grammar (SamplingParams).
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if n_out >= params.min_tokens:
        last = request.all_token_ids[-1]
        if last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        # A set: O(1) per token however many stop ids the request carries.
        if last in params.stop_token_set:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_tokens >= max_model_len or (
            request.max_tokens is not None and n_out >= request.max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
