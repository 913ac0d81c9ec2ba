"""slotserve: an LLM inference and serving engine (vLLM-V1-style, slot-safe scheduling)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slotserve.engine.args import EngineArgs
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.entrypoints.async_llm import AsyncLLM, StreamingInput
    from slotserve.entrypoints.llm import LLM
    from slotserve.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "StreamingInput", "SamplingParams", "LLMEngine", "EngineArgs",
           "RequestOutput", "CompletionOutput", "LoRARequest"]

# Imported on first use: these pull in torch and transformers, which `import slotserve`
# (e.g. for SamplingParams in a client) should not pay for.
_LAZY = {
    "LLM": "slotserve.entrypoints.llm",
    "AsyncLLM": "slotserve.entrypoints.async_llm",
    "StreamingInput": "slotserve.entrypoints.async_llm",
    "LLMEngine": "slotserve.engine.llm_engine",
    "EngineArgs": "slotserve.engine.args",
    "RequestOutput": "slotserve.outputs",
    "CompletionOutput": "slotserve.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slotserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
