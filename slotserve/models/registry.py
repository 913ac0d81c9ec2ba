"""Architecture name (config.json `architectures`) -> the module class that runs it."""

from __future__ import annotations

from slotserve.errors import ModelLoadError
from slotserve.models.gemma3 import Gemma3ForCausalLM
from slotserve.models.layers import DecoderForCausalLM
from slotserve.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ModelLoadError(f"no model class for architecture {architecture!r}") from None
