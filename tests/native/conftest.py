"""GGUF files the native runner runs: tiny random Llama and Gemma 3 models whose every matrix
fits the kernels' blocks (widths of 256), converted with the bundled model's tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from slotserve.engine.args import DEFAULT_MODEL
from tests.checkpoint.conftest import bundled_gguf
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.tiny_models import build_tiny

__all__ = ["bundled_gguf", "native_gguf"]
NativeGGUF = Callable[[str, Q], Path]
# Multiples of 256 (a K-quant block) wherever a row has to be blocks; the bundled model's
# vocabulary, so its tokenizer goes into the file.
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def native_gguf(tmp_path_factory: pytest.TempPathFactory) -> NativeGGUF:
    """`make(arch, qtype) -> path`: arch "llama" (GQA, untied, Llama 3.1 RoPE) or "gemma3"
    (sliding and global layers, each with its RoPE, q/k norms, tied)."""
    made: dict[tuple[str, Q], Path] = {}

    def make(arch: str, qtype: Q) -> Path:
        if (arch, qtype) not in made:
            root = tmp_path_factory.mktemp(f"native-{arch}-{qtype.name}")
            extra = {"head_dim": 64} if arch == "gemma3" else {}
            tiny = build_tiny(arch, root / "hf", seed=5, **SHAPE, **extra)
            to_gguf(tiny.hf, root / "model.gguf", qtype, tokenizer_dir=Path(DEFAULT_MODEL))
            made[arch, qtype] = root / "model.gguf"
        return made[arch, qtype]

    return make
