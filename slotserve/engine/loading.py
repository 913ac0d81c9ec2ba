"""The two places where the engine reads a model path for its front: the model's config and
its tokenizer, from a Hugging Face folder or a GGUF file (`slotserve.checkpoint`). (The core
loads the weights through `slotserve.models.loader`.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import slotserve.checkpoint as checkpoint
from slotserve.model_config import ModelConfig

if TYPE_CHECKING:  # transformers takes a while to import; the front loads it on first use
    from transformers import PreTrainedTokenizerBase

    from slotserve.checkpoint.saved_tokenizer import SavedTokenizer


def load_model_config(path: str) -> ModelConfig:
    return checkpoint.resolve_checkpoint(path).config


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | SavedTokenizer:
    return checkpoint.load_tokenizer(path)


def eos_token_ids(model_config: ModelConfig,
                  tokenizer: PreTrainedTokenizerBase | SavedTokenizer) -> list[int]:
    """The model's EOS ids, else the tokenizer's."""
    if model_config.eos_token_id:
        return list(model_config.eos_token_id)
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else []
