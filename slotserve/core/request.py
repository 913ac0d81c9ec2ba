"""A request as the scheduler sees it: token lists, progress cursor, status."""

from __future__ import annotations

import enum
import os
import time

from slotserve.core.structured_output import StructuredOutputRequest
from slotserve.errors import RequestValidationError
from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams

# The core trusts the requests the front validated (engine/processor.py); under
# SLOTSERVE_CHECK (every test) it asserts them again where they are built and admitted
# (check_request), which a served core would pay as an O(prompt) scan in its step process.
CHECK_REQUESTS = os.environ.get("SLOTSERVE_CHECK", "") not in ("", "0", "false", "False")


class RequestStatus(enum.IntEnum):
    # Ordered as in vLLM: everything after PREEMPTED is finished.
    WAITING = enum.auto()
    # Its grammar compiles (vLLM's WAITING_FOR_FSM): schedule() passes it by, no slot held.
    WAITING_FOR_GRAMMAR = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.WAITING_FOR_STREAMING_REQ: "stop",
}


def validate_token_ids(token_ids: object) -> list[int]:
    if not isinstance(token_ids, list | tuple):
        raise RequestValidationError("prompt_token_ids must be a list of integers",
                                     "prompt_token_ids")
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestValidationError(f"prompt token id {t!r} is not an integer",
                                         "prompt_token_ids")
        if t < 0:
            raise RequestValidationError(f"prompt token id {t} is negative", "prompt_token_ids")
    return list(token_ids)


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority",
        "arrival_time", "resumable", "cache_salt", "status", "_output_token_ids",
        "_all_token_ids", "num_computed_tokens", "num_cached_tokens", "stop_reason",
        "num_preemptions", "block_hashes", "max_tokens", "structured_output_request",
        "chunk", "lora_request", "client", "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resumable: bool = False,
        cache_salt: str | None = None,
        structured_output_request: StructuredOutputRequest | None = None,
        chunk: int = 0,
        lora_request: LoRARequest | None = None,
        client: str | None = None,
    ) -> None:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if CHECK_REQUESTS:
            check_request(request_id, prompt_token_ids, sampling_params, priority)
        self.prompt_token_ids = list(prompt_token_ids)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = None if sampling_params.ignore_eos else eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.resumable = resumable
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.max_tokens = sampling_params.max_tokens
        # The grammar every kept output token advances (a session's spans its chunks).
        self.structured_output_request = structured_output_request
        # The session chunk it is, as the front numbered it (0 for any other request); the
        # fold sets it to each next chunk's, and every output echoes it.
        self.chunk = chunk
        # Its adapter (None: the base model); the prefix cache keys its blocks by it.
        self.lora_request = lora_request
        # Who sent it (the server's `user` or peer address; None offline): among requests
        # waiting for a slot, the client holding the fewest goes first (scheduler.py).
        self.client = client

    # vLLM-style read access; the lists themselves are owned by the request.
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)

    def __lt__(self, other: Request) -> bool:
        # Lower priority value first, then earlier arrival, then id for a total order.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


def check_request(request_id: object, prompt_token_ids: object, sampling_params: object,
                  priority: object) -> None:
    """What the front guarantees of a core request (asserted under SLOTSERVE_CHECK)."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestValidationError("request_id must be a non-empty string", "request_id")
    if not isinstance(sampling_params, SamplingParams):
        raise RequestValidationError("sampling_params must be a SamplingParams",
                                     "sampling_params")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestValidationError("priority must be an integer", "priority")
    validate_token_ids(prompt_token_ids)


def check_new_request(request: Request) -> None:
    """A request that starts (not a session's next chunk), asserted under SLOTSERVE_CHECK."""
    if not request.prompt_token_ids:
        raise RequestValidationError("the prompt is empty", "prompt")
    if request.status != RequestStatus.WAITING or request.num_output_tokens:
        raise RequestValidationError(f"request {request.request_id!r} was already used",
                                     "request_id")
