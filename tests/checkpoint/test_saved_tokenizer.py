"""A GGUF file's tokenizer in the front is `SavedTokenizer` (no transformers): it must give
what transformers' fast tokenizer over the same cache entry gives, method by method, and
llguidance's tokenizer built from it must be the one `llguidance.hf.from_tokenizer` builds."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from slotserve.checkpoint import load_tokenizer
from slotserve.checkpoint.saved_tokenizer import SavedTokenizer, bpe_from_lists
from slotserve.structured_output.backend import ll_tokenizer
from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q

TEXTS = ["The capital of France is", " leading space", "two  spaces", "", "tabs\tand\nnew",
         "Ünïcödé façade — 日本語", "emoji 🤖", "<s> a literal bos </s>", "1234567 3.14159"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def saved(bundled_gguf: BundledGGUF) -> SavedTokenizer:
    tok = load_tokenizer(bundled_gguf(Q.Q8_0))
    assert isinstance(tok, SavedTokenizer)
    return tok


def test_same_results_as_transformers(saved: SavedTokenizer) -> None:
    hf = saved.to_hf()
    assert hf.backend_tokenizer.to_str() == saved.backend_tokenizer.to_str()
    assert (len(saved), saved.vocab_size) == (len(hf), hf.vocab_size)
    assert saved.special_tokens_map == {k: v for k, v in hf.special_tokens_map.items()
                                        if isinstance(v, str)}
    assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id, saved.unk_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id)
    assert saved.bos_token_id is not None and saved.eos_token_id is not None
    assert saved.get_added_vocab() == hf.get_added_vocab()
    assert saved.get_vocab() == hf.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = saved.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            assert saved(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert saved.decode(ids, skip_special_tokens=skip) == \
                    hf.decode(ids, skip_special_tokens=skip), (text, special, skip)
    tokens = ["<s>", "</s>", "the", "no-such-token"]
    assert saved.convert_tokens_to_ids(tokens) == [hf.convert_tokens_to_ids(t)
                                                   if t in hf.get_vocab() else None
                                                   for t in tokens]
    assert saved.convert_ids_to_tokens([0, 1, 2, 5]) == hf.convert_ids_to_tokens([0, 1, 2, 5])
    for generation in (True, False):
        kwargs = {"chat_template": saved.chat_template or TEMPLATE,
                  "add_generation_prompt": generation}
        text = saved.apply_chat_template(CHAT, tokenize=False, **kwargs)
        assert text == hf.apply_chat_template(CHAT, tokenize=False, **kwargs)
        assert saved.apply_chat_template(CHAT, **kwargs) == saved.encode(
            str(text), add_special_tokens=False)


def test_grammar_tokenizer_equals_llguidance_own(saved: SavedTokenizer) -> None:
    import llguidance.hf

    eos = [saved.eos_token_id or 0]
    ours = ll_tokenizer(saved, len(saved) + 7, eos)
    theirs = llguidance.hf.from_tokenizer(saved.to_hf(), n_vocab=len(saved) + 7, eos_token=eos)
    assert (ours.vocab_size, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_tokens)
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text), text
    ids = saved.encode("The capital of France is", add_special_tokens=False)
    assert ours.decode_str(ids) == theirs.decode_str(ids)



def test_vocabulary_built_from_lists_is_the_files(saved: SavedTokenizer) -> None:
    """`load_backend` builds a BPE model from parsed lists (less heap kept than from_file's
    JSON tree): the tokenizer is the file's, serialization for serialization."""
    text = saved.tokenizer_file.read_text()
    built = bpe_from_lists(json.loads(text))
    assert built is not None  # the bundled model's tokenizer takes that path
    assert built.to_str() == Tokenizer.from_file(str(saved.tokenizer_file)).to_str()
    assert saved.backend_tokenizer.to_str() == built.to_str()
    # Another model type loads as from_file loads it.
    doc = json.loads(text)
    doc["model"] = {"type": "WordLevel", "vocab": {"a": 0, "<unk>": 1}, "unk_token": "<unk>"}
    doc["added_tokens"] = []
    assert bpe_from_lists(json.loads(json.dumps(doc))) is None
