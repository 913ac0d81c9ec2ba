"""Engine settings, split as in vLLM: what the scheduler needs and what the KV cache needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slotserve.errors import RequestValidationError


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # 0 disables; otherwise a running prefill gets at most this many tokens per step.
    long_prefill_token_threshold: int = 0
    # A paused streaming session with no new chunk for this long is ended (vLLM PR #53321).
    streaming_session_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise RequestValidationError(f"unknown policy {self.policy!r}", "policy")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise RequestValidationError(f"{name} must be >= 1", name)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step, or it would block the queue.
            raise RequestValidationError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len",
                "max_num_batched_tokens")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise RequestValidationError("block_size must be >= 1", "block_size")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise RequestValidationError("num_blocks must be >= 2 (block 0 is the null block)",
                                         "num_blocks")
