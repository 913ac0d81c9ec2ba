"""EngineArgs: the flat keyword arguments of `LLM(...)` and `slotserve serve`, and how they
become one frozen EngineConfig once the model's limits and the KV cache size are known."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from slotserve.config import (
    CacheConfig,
    EngineConfig,
    KVCacheDtype,
    ModelImpl,
    QuantizationMode,
    SchedulerConfig,
    check_kv_cache_dtype,
    check_mode,
    check_model_impl,
)
from slotserve.errors import ConfigError, ModelLoadError
from slotserve.lora.request import LoRAConfig, LoRARequest, parse_lora_modules
from slotserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The bundled Shakespeare model (slotserve/default_model), used when no model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "default_model")
# Without an explicit max_model_len, a model's full context (often 32k-128k) would make every
# per-slot buffer huge on a CPU; this cap keeps the default practical.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The environment switches, read once in EngineArgs.from_kwargs.
CHECK_ENV, TRACE_ENV, NATIVE_ATTENTION_ENV, PLUGINS_ENV = (
    "SLOTSERVE_CHECK", "SLOTSERVE_TRACE", "SLOTSERVE_NATIVE_ATTENTION", "SLOTSERVE_PLUGINS")


def _arg(default: T, help: str, *aliases: str) -> T:
    """A field of the one table of engine arguments: `LLM(...)` takes its name, and the
    command line its flag (--name-with-dashes, and any aliases) with this help."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str = _arg(DEFAULT_MODEL, "a local Hugging Face model folder or .gguf file "
                      "(default: the bundled model)")
    tokenizer: str | None = _arg(None, "the tokenizer's folder (default: the model's)")
    dtype: str = _arg("auto", "weights and activations: auto, float32, bfloat16, float16")
    device: str = _arg("auto", "cpu, cuda, cuda:N; auto: a GPU when there is one")
    max_num_seqs: int = _arg(256, "requests that run at once (the worker's slots)")
    max_num_batched_tokens: int | None = _arg(None, "tokens per step (default: 2048)")
    max_model_len: int | None = _arg(None, "context length (default: the model's, at most "
                                     f"{DEFAULT_MAX_MODEL_LEN_CAP}, or what the cache holds)")
    block_size: int = _arg(16, "tokens per KV block")
    num_blocks: int | None = _arg(None, "KV blocks (default: from --kv-cache-memory)")
    # When num_blocks is not given, the startup derives it from this budget.
    kv_cache_memory: int | float | None = _arg(
        None, "KV cache budget: bytes, or a fraction of the free memory")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of shared prompt prefixes",
                                       "--prefix-caching")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps")
    long_prefill_token_threshold: int = _arg(0, "at most this many prompt tokens of one "
                                             "request per step (0: no limit)")
    policy: Literal["fcfs", "priority"] = _arg("fcfs", "the scheduling policy")
    streaming_session_timeout_s: float = _arg(600.0, "end a session idle this many seconds",
                                              "--streaming-session-timeout")
    idle_slot_grace_s: float = _arg(1.0, "seconds an idle session keeps a worker slot that a "
                                    "waiting request needs", "--idle-slot-grace")
    # None: half the slots (at least one), so that idle sessions never hold every slot.
    max_idle_sessions: int | None = _arg(None, "idle sessions that may keep their slot and KV "
                                         "(default: half of --max-num-seqs, at least 1)")
    check: bool = _arg(False, "run the scheduler/worker invariant checker every step")
    trace_path: str | None = _arg(None, "record the scheduler's calls to this JSON-lines file")
    seed: int | None = _arg(None, "seed of the engine's random state")
    native_attention: bool = _arg(True, "decode attention in the native CPU kernel where it "
                                  "builds (float32 on the CPU)")
    # models/quantization.py
    quantization: QuantizationMode = _arg(
        "auto", "auto: keep a GGUF file's quantized weights where a kernel runs them, with "
        "8-bit activations as llama.cpp; exact: the same with float32 activations; none: "
        "dequantize every weight at load")
    # slotserve/native: a GGUF file on the CPU run by the native kernels, without torch.
    model_impl: ModelImpl = _arg(
        "auto", "native: the engine core without torch (a GGUF file on the CPU with "
        "--quantization auto, every step in the native kernels); torch: the torch model; "
        "auto: native where it runs (no LoRA), else torch")
    # models/kv_storage.py: int8 is q8_0 blocks of one head's values (llama.cpp's q8_0 cache).
    kv_cache_dtype: KVCacheDtype = _arg(
        "auto", "how the KV cache stores K/V: auto (the model dtype; float16 for a GGUF "
        "file run in float32, as llama.cpp), float32, bfloat16, float16, int8")
    # engine/kv_events.py: for KV-aware routers; None: off.
    kv_events_endpoint: str | None = _arg(None, "publish KV-cache events (vLLM's format) on a "
                                          "ZMQ PUB socket bound here, e.g. tcp://*:5557")
    grammar_compile_timeout_s: float = _arg(10.0, "refuse a request whose grammar is not "
                                            "compiled within this many seconds")
    # None: overlapped when the model runs on an accelerator, whose forward pass leaves the
    # CPU free; inline on the CPU, where the forward pass keeps the cores busy and a handoff
    # per step costs a context switch.
    grammar_bitmask_overlap: bool | None = _arg(
        None, "fill grammar bitmasks on a helper thread during the forward pass (default: "
        "on an accelerator)")

    # spec_decode/config.py: a JSON object on the command line, a dict in LLM(...).
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = _arg(
        None, 'speculative decoding without a draft model, vLLM\'s JSON: {"method": "ngram" '
        'or "suffix", "num_speculative_tokens": k, "prompt_lookup_min": n, ...} (default: off)')
    # slotserve/lora: adapters batched on the base model.
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT folders) on the base model")
    max_loras: int = _arg(1, "adapters in one step (the worker's adapter slots)")
    max_lora_rank: int = _arg(16, "the largest adapter rank")
    max_cpu_loras: int | None = _arg(None, "adapters kept read in host memory (default: "
                                     "max_loras)")
    lora_modules: list[str] | None = _arg(None, "adapters known at start: name=path ...")

    plugins: str | None = _arg(None, "comma-separated modules imported where the engine core "
                               "runs (vLLM's general plugins; they may add utilities)")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """The one entry for engine settings; the environment switches are read here, once,
        and carried as arguments from then on: SLOTSERVE_CHECK=1 turns the checker on for any
        engine, SLOTSERVE_TRACE=PATH records a trace unless a trace_path is given, and
        SLOTSERVE_NATIVE_ATTENTION=0 keeps decode attention on the torch path, and
        SLOTSERVE_PLUGINS=MODULES names plugins unless `plugins` is given."""
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
        if "plugins" not in given and os.environ.get(PLUGINS_ENV):
            given["plugins"] = os.environ[PLUGINS_ENV]
        if os.environ.get(NATIVE_ATTENTION_ENV) == "0" and "native_attention" not in given:
            given["native_attention"] = False
        check_mode(given.get("quantization", "auto"))
        check_model_impl(given.get("model_impl", "auto"))
        check_kv_cache_dtype(given.get("kv_cache_dtype", "auto"))
        if "speculative_config" in given:
            given["speculative_config"] = SpeculativeConfig.from_any(given["speculative_config"])
        args = cls(**given)
        args.lora_config()  # a ConfigError now, not when the engine starts
        args.lora_requests()
        return args

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("lora_modules needs enable_lora")
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def lora_requests(self) -> list[LoRARequest]:
        """The adapters of --lora-modules, with ids 1, 2, ..."""
        return parse_lora_modules(self.lora_modules)

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
            speculative_config=SpeculativeConfig.from_any(self.speculative_config),
            max_loras=self.max_loras if self.enable_lora else 0,
        )
        cache_config = CacheConfig(num_blocks=num_blocks, block_size=self.block_size,
                                   enable_prefix_caching=self.enable_prefix_caching,
                                   cache_dtype=self.kv_cache_dtype)
        return EngineConfig(scheduler_config, cache_config, check=self.check,
                            trace_path=self.trace_path,
                            kv_events_endpoint=self.kv_events_endpoint, dtype=self.dtype,
                            device=self.device, seed=self.seed,
                            native_attention=self.native_attention,
                            lora_config=self.lora_config())
