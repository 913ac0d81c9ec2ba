"""The bundled Shakespeare model written as GGUF files (with its tokenizer and chat template in
the metadata), for engine-level tests of GGUF loading on a model with real weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slotserve.engine.args import DEFAULT_MODEL
from tests.checkpoint.gguf_convert import Q, to_gguf

BundledGGUF = Callable[..., Path]


@pytest.fixture(scope="session")
def bundled_gguf(tmp_path_factory: pytest.TempPathFactory) -> BundledGGUF:
    """`make(qtype=F32, name=..., edit=None) -> path` of the bundled model as a GGUF file."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("bundled_gguf")
    made: dict[tuple[Q, str], Path] = {}

    def make(qtype: Q = Q.F32, name: str = "model.gguf", edit: object = None) -> Path:
        key = (qtype, name)
        if key not in made or edit is not None:
            hf = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
            folder = root / f"{qtype.name}-{len(made)}"
            folder.mkdir()
            to_gguf(hf, folder / name, qtype, tokenizer_dir=Path(DEFAULT_MODEL),
                    edit=edit)  # type: ignore[arg-type]
            made[key] = folder / name
        return made[key]

    return make
