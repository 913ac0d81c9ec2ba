"""Incremental detokenization, stop strings and skip_special_tokens, with a tokenizer alone."""

from __future__ import annotations

import random
from typing import Any

from slotserve.checkpoint.tokenizer import backend_tokenizer
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.sampling_params import SamplingParams
from tests.helpers import TOKENIZER_BOS as BOS, TOKENIZER_EOS as EOS

TEXT = "Héllo wörld, naïve café. 日本語のテキスト 🎉🚀 To be, or not to be"


def run(tokenizer: Any, prompt: list[int], output: list[int], params: SamplingParams,
        step: int = 1) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detok = IncrementalDetokenizer(backend_tokenizer(tokenizer), prompt, params)
    seen = []
    stop = None
    for i in range(0, len(output), step):
        stop = detok.update(output[i:i + step])
        seen.append(detok.visible_text(stop is not None))
        if stop is not None:
            break
    if stop is None:
        detok.flush()
    return detok, seen, stop


def test_multibyte_text_is_emitted_only_when_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE over this corpus splits some characters across tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok, seen, _ = run(tokenizer, [BOS], ids, SamplingParams())
    assert detok.output_text == TEXT
    for text in seen:
        assert "\ufffd" not in text
        assert TEXT.startswith(text)


def test_random_byte_tokens_match_full_decode(tokenizer: Any) -> None:
    rng = random.Random(0)
    backend = backend_tokenizer(tokenizer)

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return str(backend.decode(ids, skip_special_tokens=skip_special_tokens))
    for trial in range(50):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok, seen, _ = run(tokenizer, prompt, output, SamplingParams(), step=1 + trial % 3)
        # Whenever the prompt ends on a character boundary, the text is exactly the output's
        # own text: the prompt is not repeated and no byte is lost or doubled. (A prompt that
        # ends inside a character is decoded without that context.)
        assert detok.output_text == decode(output, True), (prompt, output)
        if not decode(prompt, True).endswith("\ufffd"):
            assert decode(prompt + output, True).endswith(detok.output_text)
        for a, b in zip(seen, seen[1:], strict=False):
            assert b.startswith(a)


def test_prompt_ending_inside_a_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("🎉🚀", add_special_tokens=False)
    assert len(ids) >= 2
    detok, _, _ = run(tokenizer, [BOS] + ids[:1], ids[1:], SamplingParams())
    # The prompt's dangling bytes cannot be completed into text by the output alone; what
    # matters is that no output byte is dropped.
    assert detok.output_text.endswith(tokenizer.decode(ids, skip_special_tokens=True)[-1])


def test_stop_string_excluded_and_truncated(tokenizer: Any) -> None:
    ids = tokenizer.encode("To be, or not to be, that is", add_special_tokens=False)
    params = SamplingParams(stop=["not to"])
    detok, seen, stop = run(tokenizer, [BOS], ids, params)
    assert stop == "not to"
    assert detok.output_text == "To be, or "
    for text in seen:
        assert "not t" not in text  # a prefix of the stop string is held back, never retracted
        assert detok.output_text.startswith(text)


def test_stop_string_included(tokenizer: Any) -> None:
    ids = tokenizer.encode("To be, or not to be, that is", add_special_tokens=False)
    params = SamplingParams(stop=["be,", "or"], include_stop_str_in_output=True)
    detok, _, stop = run(tokenizer, [BOS], ids, params)
    assert stop == "be,"
    assert detok.output_text == "To be,"


def test_earliest_stop_string_wins_within_one_update(tokenizer: Any) -> None:
    ids = tokenizer.encode("To be, or not to be", add_special_tokens=False)
    params = SamplingParams(stop=["not", "be"])
    detok, _, stop = run(tokenizer, [BOS], ids, params, step=len(ids))
    assert stop == "be"
    assert detok.output_text == "To "


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("To be, or not to be, to be", add_special_tokens=False)
    n_first = len(tokenizer.encode("To be", add_special_tokens=False))
    params = SamplingParams(stop=["be"], min_tokens=n_first + 1, max_tokens=64)
    detok, _, stop = run(tokenizer, [BOS], ids, params)
    assert stop == "be"
    assert detok.output_text == "To be, or not to "


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("To be", add_special_tokens=False) + [EOS]
    detok, _, _ = run(tokenizer, [BOS], ids, SamplingParams())
    assert detok.output_text == "To be"
    detok, _, _ = run(tokenizer, [BOS], ids, SamplingParams(skip_special_tokens=False))
    assert detok.output_text == "To be</s>"


def test_runs_of_invisible_tokens_keep_the_window_small(tokenizer: Any) -> None:
    a = tokenizer.encode("To be,", add_special_tokens=False)
    b = tokenizer.encode(" or not", add_special_tokens=False)
    unknown = len(tokenizer) + 5  # an id the tokenizer cannot decode (a model's larger vocab)
    detok = IncrementalDetokenizer(backend_tokenizer(tokenizer), [BOS], SamplingParams())
    detok.update(a)
    for _ in range(200):
        detok.update([EOS])
        detok.update([unknown])
    assert detok._pending == []  # nothing of the run is held for a later decode
    detok.update(b)
    detok.flush()
    assert detok.output_text == "To be, or not"
