"""EngineArgs: the flat keyword arguments of `LLM(...)` and `slotserve serve`, and how they
become one frozen EngineConfig once the model's limits and the KV cache size are known."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slotserve.config import (
    CacheConfig,
    EngineConfig,
    QuantizationMode,
    SchedulerConfig,
    check_mode,
)
from slotserve.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

# The bundled Shakespeare model (slotserve/default_model), used when no model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "default_model")
# Without an explicit max_model_len, a model's full context (often 32k-128k) would make every
# per-slot buffer huge on a CPU; this cap keeps the default practical.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The environment switches, read once in EngineArgs.from_kwargs.
CHECK_ENV, TRACE_ENV, NATIVE_ATTENTION_ENV = (
    "SLOTSERVE_CHECK", "SLOTSERVE_TRACE", "SLOTSERVE_NATIVE_ATTENTION")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    # KV cache budget when num_blocks is not given: bytes (int) or a fraction of free memory
    # (float); the startup derives num_blocks from it.
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    streaming_session_timeout_s: float = 600.0
    idle_slot_grace_s: float = 1.0
    # None: half the slots (at least one), so that idle sessions never hold every slot.
    max_idle_sessions: int | None = None
    check: bool = False
    trace_path: str | None = None
    seed: int | None = None
    # Decode attention in the native CPU kernel where it builds (float32 on the CPU).
    native_attention: bool = True
    # "auto": a GGUF file's quantized weights stay quantized where a native kernel runs them
    # (models/quantization.py); "none": every weight is dequantized at load.
    quantization: QuantizationMode = "auto"
    # Structured outputs: a request whose grammar is not compiled within this many seconds
    # is refused. Bitmask rows are filled on a helper thread while the forward pass runs
    # (True), or on the step loop before it (False); None: overlapped when the model runs on
    # an accelerator, whose forward pass leaves the CPU free, inline on the CPU, where the
    # forward pass keeps the cores busy and a handoff per step costs a context switch.
    grammar_compile_timeout_s: float = 10.0
    grammar_bitmask_overlap: bool | None = None
    # KV-cache events in vLLM's wire format on a ZMQ PUB socket bound here (e.g.
    # "tcp://*:5557"), for KV-aware routers (engine/kv_events.py); None: off.
    kv_events_endpoint: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """The one entry for engine settings; the environment switches are read here, once,
        and carried as arguments from then on: SLOTSERVE_CHECK=1 turns the checker on for any
        engine, SLOTSERVE_TRACE=PATH records a trace unless a trace_path is given, and
        SLOTSERVE_NATIVE_ATTENTION=0 keeps decode attention on the torch path."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        given = {k: v for k, v in kwargs.items() if v is not None}
        if os.environ.get(CHECK_ENV, "") not in ("", "0", "false", "False"):
            given["check"] = True
        if "trace_path" not in given and os.environ.get(TRACE_ENV):
            given["trace_path"] = os.environ[TRACE_ENV]
        if os.environ.get(NATIVE_ATTENTION_ENV) == "0" and "native_attention" not in given:
            given["native_attention"] = False
        check_mode(given.get("quantization", "auto"))
        return cls(**given)

    def model_path(self) -> str:
        path = os.path.expanduser(self.model)
        if not os.path.exists(path):
            raise ModelLoadError(f"model path {path!r} does not exist (slotserve loads a local "
                                 "Hugging Face model folder or a .gguf file)")
        return path

    def max_model_len_bound(self, max_position_embeddings: int) -> int:
        """max_model_len before the KV cache is sized: asked for, or the model's, capped."""
        if self.max_model_len is None:
            return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.max_model_len > max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                              f"max_position_embeddings={max_position_embeddings}")
        return self.max_model_len

    def create_engine_config(self, max_position_embeddings: int, num_blocks: int) -> EngineConfig:
        """Decide everything once: one request alone must fit into the KV cache, so a
        max_model_len that was not asked for is lowered to what the cache holds."""
        max_model_len = self.max_model_len_bound(max_position_embeddings)
        capacity = (num_blocks - 1) * self.block_size
        if max_model_len > capacity:
            if self.max_model_len is not None:
                raise ConfigError(
                    f"max_model_len={max_model_len} does not fit into the KV cache "
                    f"({num_blocks - 1} usable blocks of {self.block_size} tokens = "
                    f"{capacity}); give more num_blocks/kv_cache_memory or a smaller "
                    "max_model_len")
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache",
                           max_model_len, capacity)
            max_model_len = capacity
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit into one step's budget.
                budget = max(budget, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=self.policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            streaming_session_timeout_s=self.streaming_session_timeout_s,
            idle_slot_grace_s=self.idle_slot_grace_s,
            max_idle_sessions=(max(1, self.max_num_seqs // 2) if self.max_idle_sessions is None
                               else self.max_idle_sessions),
        )
        cache_config = CacheConfig(num_blocks=num_blocks, block_size=self.block_size,
                                   enable_prefix_caching=self.enable_prefix_caching)
        return EngineConfig(scheduler_config, cache_config, check=self.check,
                            trace_path=self.trace_path,
                            kv_events_endpoint=self.kv_events_endpoint)
