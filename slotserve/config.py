"""Engine configuration, split as in vLLM, and decided once.

`EngineArgs` (engine/args.py) holds what a user asked for; what the engine finds at startup
(the KV blocks a memory budget buys, the context length that cache can hold) is decided before
any component is built, and the frozen records below are handed to all of them, so no two
components can disagree about `max_model_len` or `num_blocks`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from slotserve.errors import ConfigError
from slotserve.lora.request import LoRAConfig
from slotserve.model_config import ModelConfig
from slotserve.spec_decode.config import SpeculativeConfig

# --quantization: "auto" keeps a GGUF file's quantized weights where a native kernel runs
# them (models/quantization.py) and multiplies them with 8-bit activations as llama.cpp does;
# "exact" keeps them too but multiplies with float32 activations (dequantize-then-matmul up
# to the order of the sums); "none" dequantizes every weight at load.
# --model-impl: what runs the model (slotserve/native: the native kernels alone, no torch).
ModelImpl = Literal["auto", "native", "torch"]
MODEL_IMPLS: tuple[ModelImpl, ...] = ("auto", "native", "torch")
QuantizationMode = Literal["auto", "exact", "none"]
QUANTIZATION_MODES: tuple[QuantizationMode, ...] = ("auto", "exact", "none")


def cache_root() -> Path:
    """The one folder for what slotserve derives once and keeps (checkpoint indexes, built
    kernels): $SLOTSERVE_CACHE_DIR, else $XDG_CACHE_HOME/slotserve, else ~/.cache/slotserve."""
    explicit = os.environ.get("SLOTSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "slotserve"


def check_mode(mode: str) -> QuantizationMode:
    for known in QUANTIZATION_MODES:
        if mode == known:
            return known
    raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, "
                      f"got {mode!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # 0 disables; otherwise a running prefill gets at most this many tokens per step.
    long_prefill_token_threshold: int = 0
    # An idle streaming session with no new chunk for this long is ended (vLLM PR #53321).
    streaming_session_timeout_s: float = 600.0
    # An idle session keeps its worker slot (and KV) at most this long while a waiting
    # request needs a slot; past it the slot goes to the waiting request (issue 11).
    idle_slot_grace_s: float = 1.0
    # At most this many idle sessions keep their slot and KV; beyond it the least important,
    # longest-idle ones give theirs up at once (None: no cap but max_num_seqs).
    max_idle_sessions: int | None = None
    # Speculative decoding without a draft model (spec_decode/); None: off.
    speculative_config: SpeculativeConfig | None = None
    # The worker's adapter slots (--max-loras with --enable-lora); 0: LoRA off.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"unknown policy {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("streaming_session_timeout_s", "idle_slot_grace_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number of seconds >= 0")
        if self.max_idle_sessions is not None and self.max_idle_sessions < 0:
            raise ConfigError("max_idle_sessions must be >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step, or it would block the queue.
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; long prompts could never be scheduled "
                "without chunked prefill")


KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "int8"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = get_args(KVCacheDtype)


def check_model_impl(name: str) -> ModelImpl:
    for known in MODEL_IMPLS:
        if name == known:
            return known
    raise ConfigError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {name!r}")


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                          f"got {name!r}")
    return name


# The native kernels' storage codes of the KV cache types (the enums in csrc/fused_ops.c and
# paged_decode.c), by --kv-cache-dtype name.
KV_STORAGE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}
KV_SCALE_BYTES = 2  # a float16 scale per int8 block, as in llama.cpp's q8_0


def int8_block(head_dim: int) -> int:
    """Values per q8_0 block of an int8 row: 32, or the whole row when head_dim is no
    multiple of 32."""
    return 32 if head_dim % 32 == 0 else head_dim


def kv_row_elems(head_dim: int, kv_dtype: str) -> int:
    """Elements of the cache per token and head for a storage type by name (int8: the values,
    then a float16 scale per block)."""
    if kv_dtype != "int8":
        return head_dim
    return head_dim + KV_SCALE_BYTES * (head_dim // int8_block(head_dim))


def kv_cache_dtype_name(name: str, model_dtype: str, gguf: bool = False) -> str:
    """The storage type `--kv-cache-dtype name` means: auto is the model's dtype, except for a
    GGUF file run in float32: float16, llama.cpp's default cache type for the same file (half
    the bytes per token, so twice the tokens in the same memory and half the attention reads;
    Gemma 3 270M's greedy continuations equal the float32 cache's,
    tests/checkpoint/test_gemma_kv_dtype.py)."""
    check_kv_cache_dtype(name)
    if name != "auto":
        return name
    return "float16" if gguf and model_dtype == "float32" else model_dtype


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # --kv-cache-dtype: how K/V rows are stored (models/kv_storage.py); auto: the model dtype
    # (float16 for a GGUF file run in float32), resolved by the engine core at startup.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.num_blocks < 2:
            raise ConfigError("num_blocks must be >= 2 (block 0 is the null block)")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What every part of one engine is built from, decided at startup."""

    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    # Run the invariant checker on every step (--check; SLOTSERVE_CHECK=1 at the entry).
    check: bool = False
    # Record every scheduler event here for a replay (SLOTSERVE_TRACE=PATH at the entry).
    trace_path: str | None = None
    # Publish KV-cache events (vLLM's format) on a ZMQ PUB socket bound here.
    kv_events_endpoint: str | None = None
    # The model runner's: weights and activations dtype and device (as the core resolved
    # them; "auto" where not: float32, a GPU when there is one), the sampler's seed, and
    # whether decode attention may run in the native CPU kernel.
    dtype: str = "auto"
    device: str = "auto"
    seed: int | None = None
    native_attention: bool = True
    # --enable-lora's settings (slotserve/lora); None: LoRA off.
    lora_config: LoRAConfig | None = None
    # The model's config as the core read it with the weights (None before): the front takes
    # it from here instead of reading the checkpoint again, which in a front process of its
    # own would import numpy and gguf (~20 MB resident) for a few numbers.
    model_config: ModelConfig | None = None

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len
