"""Fixtures shared across the test folders: a private checkpoint cache for the session, the
test tokenizer, an engine over the fake runner, and tiny random-weight checkpoints (the helpers
they use live in tests/helpers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The test utilities of the engine core (tests/core_utilities.py), in every core process too.
os.environ["SLOTSERVE_PLUGINS"] = "tests.core_utilities"

from slotserve.engine.args import EngineArgs  # noqa: E402
from slotserve.engine.core import EngineCore  # noqa: E402
from slotserve.engine.core_client import InprocClient  # noqa: E402
from slotserve.engine.llm_engine import LLMEngine  # noqa: E402
from slotserve.structured_output.backend import GuidanceBackend  # noqa: E402
from slotserve.structured_output.manager import StructuredOutputManager  # noqa: E402
from tests import core_utilities  # noqa: E402, F401 - adds the test utilities to EngineCore
from tests.helpers import (  # noqa: E402
    TINY_MODELS,
    TOKENIZER_BOS,
    TOKENIZER_EOS,
    FakeEngineFactory,
    FakeModelRunner,
    TinyModel,
    build_tiny,
    build_tokenizer,
    randomize,
)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What slotserve caches per checkpoint file goes to a folder of this session (unless the
    caller chose one), so tests never read or fill the user's ~/.cache."""
    if os.environ.get("SLOTSERVE_CACHE_DIR"):
        yield
        return
    os.environ["SLOTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("slotserve-cache"))
    try:
        yield
    finally:
        del os.environ["SLOTSERVE_CACHE_DIR"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def fake_engine(tokenizer: Any) -> FakeEngineFactory:
    """LLMEngine over the fake runner: fast, torch-free engine plumbing tests."""

    def make(num_blocks: int = 256, max_position_embeddings: int = 512,
             fail_on_step: int | None = None, **kwargs: Any) -> LLMEngine:
        kwargs.setdefault("check", True)
        args = EngineArgs.from_kwargs(model="fake", num_blocks=num_blocks, **kwargs)
        vocab = len(tokenizer)
        config = SimpleNamespace(max_position_embeddings=max_position_embeddings,
                                 vocab_size=vocab, eos_token_id=[TOKENIZER_EOS])
        runner = FakeModelRunner(args.max_num_seqs, vocab, fail_on_step)
        manager = StructuredOutputManager(
            GuidanceBackend(lambda: (tokenizer, [TOKENIZER_EOS]), vocab), args.max_num_seqs,
            compile_timeout_s=args.grammar_compile_timeout_s,
            overlap=args.grammar_bitmask_overlap is not False)
        core = EngineCore(args.create_engine_config(max_position_embeddings, num_blocks), runner,
                          manager)
        return LLMEngine(InprocClient(core), tokenizer, config)  # type: ignore[arg-type]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> SimpleNamespace:
    """A 2-layer Llama (GQA, vocab = the test tokenizer's) saved with its tokenizer; `.hf` is
    the transformers model for references."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=TOKENIZER_BOS,
                         eos_token_id=TOKENIZER_EOS, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    randomize(hf, 0)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # references run exactly max_new_tokens
    return SimpleNamespace(path=str(path), hf=hf)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """Every supported architecture, tiny and random, saved with `save_pretrained`."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_tiny(name, root / name, seed=i)
            for i, name in enumerate(TINY_MODELS)}


@pytest.fixture(params=list(TINY_MODELS))
def tiny_model(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models[request.param]


# The real Gemma file's tests load a 262k-vocabulary model and transformers' reference in
# module fixtures, which pytest-timeout counts with the first test: 284 s of setup alone on
# the loaded 2-core machine. They get a longer limit unless they set their own.
GEMMA_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gemma") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GEMMA_TIMEOUT_S))
