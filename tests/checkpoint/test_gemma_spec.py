"""Speculative decoding on the real Gemma 3 270M file: greedy with speculation (ngram and
suffix, forced on) equals greedy without, token for token, on text that copies its prompt,
text that does not, and a prompt past the 512-token sliding window; one by one, batched,
under a 64-token budget with prefix-cache hits, and under forced preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotserve import LLM, SamplingParams
from slotserve.checkpoint import load_tokenizer
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.engine.core_client import InprocClient
from slotserve.engine.llm_engine import LLMEngine
from slotserve.models.loader import load_model
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gemma_file import gemma_path

pytestmark = pytest.mark.gemma

CODE = ('def merge(intervals):\n    ordered = sorted(intervals)\n    out = [list(ordered[0])]\n'
        '    for start, end in ordered[1:]:\n        if start <= out[-1][1]:\n'
        '            out[-1][1] = max(out[-1][1], end)\n        else:\n'
        '            out.append([start, end])\n    return out\n')
LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 40))
PROMPTS = [
    f"{CODE}\n# The same function again, unchanged:\n{CODE[:40]}",
    "The three primary colors are",
    LONG,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "adaptive": False}


_LOADED: dict[str, tuple[Path, Any, Any, Any]] = {}


def load(quantization: str) -> tuple[Path, Any, Any, Any]:
    if quantization not in _LOADED:
        gemma = gemma_path()
        model, cfg = load_model(gemma, dtype="float32", device="cpu", max_positions=1025,
                                quantization=quantization)
        _LOADED[quantization] = gemma, model, cfg, load_tokenizer(gemma)
    return _LOADED[quantization]


def generate(loaded: tuple[Path, Any, Any, Any], spec: dict[str, Any] | None,
             prompts: list[str], **kwargs: Any) -> tuple[list[list[int]], Any]:
    gemma, model, cfg, tokenizer = loaded
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("max_model_len", 1024)
    args = EngineArgs.from_kwargs(model=str(gemma), dtype="float32", device="cpu", check=True,
                                  seed=0, speculative_config=spec, **kwargs)
    config = args.create_engine_config(cfg.max_position_embeddings, kwargs["num_blocks"])
    runner = ModelRunner((model, cfg), config.scheduler_config, config.cache_config,
                         dtype="float32", device="cpu", seed=0)
    core = EngineCore(config, runner)
    llm = LLM(llm_engine=LLMEngine(InprocClient(core), tokenizer, cfg))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], core.scheduler.make_stats()


_REFERENCE: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _release_models() -> Iterator[None]:
    yield
    _LOADED.clear()
    _REFERENCE.clear()


# The default quantization (int8 activations) where every prompt is prefilled whole, as in the
# run without speculation: a verify row attends as decodes do, so the tokens are the same to
# the bit. Where the budget or a preemption splits prefills into other chunks than the run
# without speculation (drafts take budget), the chunks' float rounding differs in the last bit
# and an 8-bit activation step can flip a near tie, as batching can without speculation: those
# runs use float32 activations (`exact`).
@pytest.mark.parametrize(("quantization", "spec", "kwargs"), [
    ("auto", NGRAM, {"max_num_seqs": 1}),
    ("auto", NGRAM, {}),
    ("auto", SUFFIX, {}),
    ("exact", NGRAM, {"max_num_batched_tokens": 64}),
    ("exact", NGRAM, {"num_blocks": 56, "max_num_batched_tokens": 256, "max_model_len": 800}),
], ids=["one-by-one", "batched", "suffix-batched", "budget-64", "preemption"])
def test_greedy_equal_with_speculation(quantization: str, spec: dict[str, Any],
                                       kwargs: dict[str, Any]) -> None:
    loaded = load(quantization)
    if quantization not in _REFERENCE:
        _REFERENCE[quantization] = generate(loaded, None, PROMPTS)[0]
    reference = _REFERENCE[quantization]
    # Twice over: the second copy of each prompt hits the prefix cache.
    got, stats = generate(loaded, spec, PROMPTS + PROMPTS, **kwargs)
    assert got == reference + reference
    assert stats.spec_decode_num_accepted_tokens > 32  # the copying prompt is copied
    assert stats.prefix_cache_hits > 0
    if kwargs.get("num_blocks") == 56:
        assert stats.num_preemptions > 0
