"""Fixtures for the engine tests: a tiny byte-level BPE tokenizer trained here, a fake
(torch-free) model runner, and tiny random-weight Llama checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from slotserve.engine.args import EngineArgs  # noqa: E402
from slotserve.engine.core import EngineCore  # noqa: E402
from slotserve.engine.core_client import InprocClient  # noqa: E402
from slotserve.engine.llm_engine import LLMEngine  # noqa: E402
from tests.engine.fake_runner import FakeModelRunner  # noqa: E402
from tests.models.conftest import randomize

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS, EOS = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CORPUS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles",
    "Héllo wörld, naïve café. Ünïcödé 日本語のテキスト 🎉🚀 emoji and ümlauts.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 320) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


FakeEngineFactory = Callable[..., LLMEngine]


@pytest.fixture
def fake_engine(tokenizer: Any) -> FakeEngineFactory:
    """LLMEngine over the fake runner: fast, torch-free engine plumbing tests."""

    def make(num_blocks: int = 256, max_position_embeddings: int = 512,
             fail_on_step: int | None = None, **kwargs: Any) -> LLMEngine:
        kwargs.setdefault("check", True)
        args = EngineArgs.from_kwargs(model="fake", num_blocks=num_blocks, **kwargs)
        vocab = len(tokenizer)
        config = SimpleNamespace(max_position_embeddings=max_position_embeddings,
                                 vocab_size=vocab, eos_token_id=[EOS])
        runner = FakeModelRunner(args.max_num_seqs, vocab, fail_on_step)
        core = EngineCore(args.create_engine_config(max_position_embeddings, num_blocks), runner)
        return LLMEngine(InprocClient(core), tokenizer, config)  # type: ignore[arg-type]

    return make


# ----- tiny random-weight Llama with the test tokenizer -------------------------------------

@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> SimpleNamespace:
    """A 2-layer Llama (GQA, vocab = the test tokenizer's) saved with its tokenizer; `.hf` is
    the transformers model for references."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS,
                         pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    randomize(hf, 0)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # references run exactly max_new_tokens
    return SimpleNamespace(path=str(path), hf=hf)
