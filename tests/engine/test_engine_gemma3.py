"""`LLM(model=hf_folder)` on a tiny random Gemma 3 text checkpoint, checker on.

Greedy outputs equal transformers' `generate` for prompts that run past the 6-token sliding
window, batched together, with shared-prefix cache hits, chunked under a small budget and
under KV pressure (preemption).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slotserve.entrypoints.llm import LLM
from tests.engine.test_engine_model import GREEDY, NEW_TOKENS, PROMPTS, as_inputs
from tests.helpers import build_tiny, hf_greedy


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> SimpleNamespace:
    path: Path = tmp_path_factory.mktemp("tiny_gemma3")
    model = build_tiny("gemma3", path, seed=3, vocab_size=len(tokenizer), bos_token_id=0,
                       eos_token_id=1, pad_token_id=2)
    tokenizer.save_pretrained(path)
    refs = [hf_greedy(model.hf, p, NEW_TOKENS)[0] for p in PROMPTS]
    return SimpleNamespace(path=str(path), hf=model.hf, refs=refs)


@pytest.mark.parametrize("engine_kwargs", [
    {"num_blocks": 128},
    {"num_blocks": 14, "block_size": 8, "max_num_batched_tokens": 16},
], ids=["together", "chunked-16-preemption"])
def test_llm_generate_matches_hf(tiny_gemma3: SimpleNamespace,
                                 engine_kwargs: dict[str, Any]) -> None:
    llm = LLM(tiny_gemma3.path, dtype="float32", device="cpu", check=True, **engine_kwargs)
    outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny_gemma3.refs
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0
    if engine_kwargs["num_blocks"] < 20:
        assert stats.num_preemptions > 0
    text = llm.generate(["To be, or not"], GREEDY, use_tqdm=False)[0]
    ids = llm.get_tokenizer()("To be, or not")["input_ids"]
    assert text.outputs[0].token_ids == hf_greedy(tiny_gemma3.hf, ids, NEW_TOKENS)[0]
    assert isinstance(text.outputs[0].text, str) and text.outputs[0].text
