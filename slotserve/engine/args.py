"""EngineArgs: the flat keyword arguments of `LLM(...)` and `slotserve serve`, and how they
become a SchedulerConfig and a CacheConfig once the model's own limits are known."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.errors import ModelLoadError, RequestValidationError

# The bundled Shakespeare model (slotserve/default_model), used when no model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "default_model")
# Without an explicit max_model_len, a model's full context (often 32k-128k) would make every
# per-slot buffer huge on a CPU; this cap keeps the default practical.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# SLOTSERVE_NATIVE_ATTENTION=0 keeps decode attention on the torch path; read here only, when
# the arguments are made, and carried as `native_attention` to the model from then on.
NATIVE_ATTENTION_ENV = "SLOTSERVE_NATIVE_ATTENTION"


def _native_attention_default() -> bool:
    return os.environ.get(NATIVE_ATTENTION_ENV, "1") != "0"


@dataclass(slots=True)
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
    # (float); the model runner derives num_blocks from it.
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    streaming_session_timeout_s: float = 600.0
    check: bool = False
    seed: int | None = None
    # Decode attention in the native CPU kernel where it builds (float32 on the CPU).
    native_attention: bool = dataclasses.field(default_factory=_native_attention_default)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        args = cls(**{k: v for k, v in kwargs.items() if v is not None or k == "model"})
        if args.model is None:
            args.model = DEFAULT_MODEL
        return args

    def model_path(self) -> str:
        path = os.path.expanduser(str(self.model))
        if not os.path.exists(path):
            raise ModelLoadError(f"model path {path!r} does not exist (slotserve loads a local "
                                 "Hugging Face model folder or a .gguf file)")
        return path

    def resolve_max_model_len(self, max_position_embeddings: int | None) -> int:
        limit = max_position_embeddings or DEFAULT_MAX_MODEL_LEN_CAP
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.max_model_len > limit:
            raise RequestValidationError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}", "max_model_len")
        return self.max_model_len

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit into one step's budget.
                budget = max(budget, max_model_len)
        elif not self.enable_chunked_prefill and budget < max_model_len:
            raise RequestValidationError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}; "
                "long prompts could never be scheduled without chunked prefill",
                "max_num_batched_tokens")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=self.policy,  # type: ignore[arg-type]
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            streaming_session_timeout_s=self.streaming_session_timeout_s,
        )

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching)
