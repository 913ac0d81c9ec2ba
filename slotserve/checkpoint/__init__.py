"""Checkpoints on disk -> model config, named weight tensors and tokenizer.

`resolve_checkpoint(path)` gives a `Checkpoint` (format, `ModelConfig`, weights reader) for a
Hugging Face folder or a GGUF file; `load_tokenizer(path)` its tokenizer. Readers deliver
Hugging Face-named tensors; the model classes own how those fill their parameters.
"""

from slotserve.checkpoint.resolve import Checkpoint, WeightsReader, find_gguf, resolve_checkpoint
from slotserve.checkpoint.tokenizer import load_tokenizer

__all__ = ["Checkpoint", "WeightsReader", "find_gguf", "load_tokenizer", "resolve_checkpoint"]
