"""The streaming detokenizer on the real Gemma vocabulary: a run of byte-fallback tokens that
makes `tokenizers`' DecodeStream raise "Invalid prefix encountered" (seen serving random
prompts: the exception failed every request of the server's output handler) is decoded on."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers.decoders import DecodeStream

from slotserve.checkpoint import load_tokenizer
from slotserve.checkpoint.tokenizer import backend_tokenizer
from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gemma

# Byte-fallback tokens <0x..> then a Cyrillic piece: found by a random search over Gemma's ids.
INVALID_PREFIX_RUN = [300, 447, 437, 325, 239, 236801]


def test_invalid_prefix_run_is_decoded_not_raised(gemma: Path) -> None:
    tok = backend_tokenizer(load_tokenizer(gemma))
    stream = DecodeStream([], False)
    with pytest.raises(Exception, match="Invalid prefix"):
        for t in INVALID_PREFIX_RUN:
            stream.step(tok, t)
    detok = IncrementalDetokenizer(tok, [2, 818], SamplingParams(max_tokens=16))
    for t in INVALID_PREFIX_RUN + [5000, 100]:
        detok.update([t])
    detok.flush()
    assert detok.num_output_tokens == len(INVALID_PREFIX_RUN) + 2
    # The tokens after the reset are decoded as before: the Cyrillic piece and the next word.
    assert tok.decode([236801], False) in detok.output_text
    assert detok.output_text.endswith(tok.decode([5000], True) + tok.decode([100], True))
