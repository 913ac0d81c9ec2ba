"""What crosses the boundary between the engine's front and its core (vLLM's EngineCore
protocol): typed requests in, typed output batches out, whether the core runs in this thread,
on a background thread or in a child process.

The front (LLMEngine, AsyncLLM) validates, tokenizes and detokenizes; the core sees token ids
only. Everything here pickles, so the same messages travel a pipe in process mode.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

from slotserve.core.outputs import EngineCoreOutput
from slotserve.core.sched_utils import SchedulerStats
from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """What a message to the core asks for (the payload type is named after each)."""

    ADD = enum.auto()  # EngineCoreRequest
    ABORT = enum.auto()  # list[str]: core request ids
    UTILITY = enum.auto()  # UtilityCall
    SHUTDOWN = enum.auto()  # None
    WAKE = enum.auto()  # None: a grammar compiled; an idle loop looks again


@dataclass(slots=True)
class EngineCoreRequest:
    """One core request: a whole request, one sequence of an n > 1 request, or the next chunk
    (or the end mark) of a streaming-input session."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    resumable: bool = False
    # The next chunk or the end mark of a session the front knows. The session may have ended
    # in the core meanwhile (an idle timeout); then the core drops the message, as its end has
    # already been sent.
    continues_session: bool = False
    # A session's chunk index, given by the front (0, 1, ...; the end mark takes the next):
    # every output of the chunk echoes it, and its end is an event (EngineCoreOutput).
    chunk: int = 0
    # The llguidance grammar every output token must keep (built and checked by the front
    # from sampling_params.structured_outputs); the core compiles it before scheduling. A
    # session's grammar comes with its first chunk and spans all of them.
    grammar: str | None = None
    # Who sent it (the API's admission key: `user`, else the peer address): the core takes
    # grammar compiles round-robin over clients. None: an anonymous client (offline use).
    client: str | None = None
    # Its adapter (checked by the front); None: the base model.
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class UtilityCall:
    """`EngineCore.<method>(*args)` run between two steps, sent by name as vLLM sends its
    utilities (the names a front uses: EngineCoreClient; SLOTSERVE_PLUGINS may add some)."""

    call_id: int
    method: str
    args: tuple[Any, ...]


@dataclass(slots=True)
class UtilityResult:
    call_id: int
    # The return value, or the exception the call raised.
    value: Any
    failed: bool = False


@dataclass(slots=True)
class EngineStats(SchedulerStats):
    """The scheduler's snapshot plus the engine's own counters (cumulative since start)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_failed_steps: int = 0
    # Requests the worker failed alone, the rest of their step running normally.
    num_failed_requests: int = 0
    # How busy the front keeps the core: steps run, and wall / CPU seconds inside them.
    num_steps: int = 0
    busy_s: float = 0.0
    busy_cpu_s: float = 0.0
    # Structured outputs: requests waiting for their grammar (they hold no slot), grammars
    # compiled and their seconds, bitmask rows filled, the seconds filling them, and the part
    # the step loop waited for.
    num_waiting_for_grammar: int = 0
    num_grammars_compiled: int = 0
    grammar_compile_s: float = 0.0
    num_grammar_mask_rows: int = 0
    grammar_mask_fill_s: float = 0.0
    grammar_mask_wait_s: float = 0.0
    # The compiled-grammar cache now: entries, and the bytes they are charged (what the
    # process grew by while compiling each, bounded by max_cached_bytes).
    grammar_cache_entries: int = 0
    grammar_cache_bytes: int = 0
    # Memory of the core: the model's weights (quantized blocks included) and the KV cache
    # allocation in bytes, and the core process's resident set when the stats were taken.
    weights_bytes: int = 0
    quantized_weights_bytes: int = 0
    kv_cache_bytes: int = 0
    resident_bytes: int = 0


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's outputs: token ids per core request, and when they were made."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Monotonic time when the step's schedule() ran and when its outputs were made.
    schedule_time: float = 0.0
    timestamp: float = 0.0
    # Requests (re)admitted this step (their first scheduling time is schedule_time).
    scheduled_new_req_ids: list[str] = field(default_factory=list)
    # The model step failed: its requests end with finish_reason "error"; the core goes on.
    step_error: BaseException | None = None


def portable(exc: BaseException) -> BaseException:
    """An exception that survives the pipe (or a RuntimeError carrying its text)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
