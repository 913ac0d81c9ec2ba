"""The two places where the engine reads a model folder for its front: the model's config and
its tokenizer. (The core loads the weights through `slotserve.models.loader`.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from slotserve.errors import ModelLoadError
from slotserve.models.config import ModelConfig

if TYPE_CHECKING:  # transformers takes a while to import; the front loads it on first use
    from transformers import PreTrainedTokenizerBase


def load_model_config(path: str) -> ModelConfig:
    return ModelConfig.from_pretrained(path)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer. A plain tokenizer.json tokenizer is loaded directly: going
    through AutoTokenizer costs seconds of imports that `slotserve generate` would pay."""
    import transformers

    try:
        folder = Path(path)
        config_file = folder / "tokenizer_config.json"
        if (folder / "tokenizer.json").is_file() and config_file.is_file():
            declared = json.loads(config_file.read_text()).get("tokenizer_class")
            if declared in (None, "PreTrainedTokenizerFast"):
                tokenizer: PreTrainedTokenizerBase = (
                    transformers.PreTrainedTokenizerFast.from_pretrained(path))
                return tokenizer
        auto: PreTrainedTokenizerBase = transformers.AutoTokenizer.from_pretrained(path)
        return auto
    except Exception as exc:  # transformers raises many types for a bad folder
        raise ModelLoadError(f"could not load a tokenizer from {path!r}: {exc}") from exc


def eos_token_ids(model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The model's EOS ids, else the tokenizer's."""
    if model_config.eos_token_id:
        return list(model_config.eos_token_id)
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else []
