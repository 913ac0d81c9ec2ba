"""The real Gemma 3 file's tokenizer and chat setup: prompt ids equal transformers' (built
from the same metadata by `AutoTokenizer.from_pretrained(dir, gguf_file=...)`), BOS included;
the file has no chat template, so Gemma's turn format is used, and said so."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from slotserve.checkpoint import load_tokenizer, resolve_checkpoint
from slotserve.engine.processor import apply_chat_template
from tests.checkpoint.gemma_file import gemma_path

pytestmark = pytest.mark.gemma

TEXTS = [
    "The capital of France is", " leading space", "two  spaces   and three", "",
    "tabs\tand\nnew\n\nlines\r\n", "Ünïcödé façade — “quotes” 日本語のテキスト", "emoji 🤖🎉",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<bos>a literal bos", "1234567 3.14159",
    "def f(x):\n    return x ** 2  # code", "trailing   ", "\u00a0nbsp x\u200by",
]


@pytest.fixture(scope="module")
def gemma() -> Path:
    return gemma_path()


@pytest.fixture(scope="module")
def reference(gemma: Path, gguf_parsed_once: Callable[[], AbstractContextManager[None]]) -> Any:
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(gemma.parent), gguf_file=gemma.name)


def test_prompt_ids_equal_transformers(gemma: Path, reference: Any) -> None:
    ours = load_tokenizer(gemma)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                reference.encode(text, add_special_tokens=special), (text, special)
    assert ours.encode("Hi")[0] == 2 == ours.bos_token_id  # the file says add BOS
    assert len(ours) == len(reference) == 262144
    ids = ours.encode(TEXTS[5], add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == TEXTS[5]


def test_metadata_config(gemma: Path) -> None:
    cfg = resolve_checkpoint(gemma).config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (640, 18, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings
    assert cfg.rope.theta == 1_000_000.0
    assert cfg.rope_local is not None and cfg.rope_local.theta == 10_000.0
    assert cfg.query_pre_attn_scalar == 256 and cfg.hidden_act == "gelu_pytorch_tanh"
    windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert set(windows) == {None, 512}
    assert cfg.eos_token_id == [1, 106]  # <eos> and <end_of_turn>


def test_chat_falls_back_to_gemma_turns(gemma: Path, reference: Any,
                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(gemma)
    assert "has no chat template; using the gemma turn format" in caplog.text
    conv = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello there "},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "Bye"}]
    prompt = apply_chat_template(tok, conv)
    assert prompt["prompt"] == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHello there<end_of_turn>\n"
        "<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    # One BOS, the turn markers as single special tokens, as transformers tokenizes the text.
    assert prompt["prompt_token_ids"] == reference.encode(prompt["prompt"],
                                                          add_special_tokens=False)
    assert prompt["prompt_token_ids"].count(2) == 1
    assert prompt["prompt_token_ids"].count(106) == 3  # <end_of_turn>
