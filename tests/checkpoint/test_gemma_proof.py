"""The real Gemma 3 270M Q4_K_M GGUF generates exactly what transformers generates from the
same file (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, dequantized, float32):
the same 32 greedy tokens on seven prompts, one longer than the 512-token sliding window, and
the sampled tokens' logprobs within LOGPROB_TOL, whether the prompts run one by one, together
in one batch, again with prefix-cache hits, in chunks under a 64-token budget, or under
forced preemption.

The model is loaded with `--quantization exact` (the file's blocks with float32 activations:
the same values transformers dequantizes, only the order of the float32 sums differs); the
default int8 activations are held to llama.cpp's own agreement with transformers instead, in
test_gemma_quantized.py. It is loaded once for the module and shared by the engines (each
engine only adds its KV cache); the transformers reference is computed once (only this module
uses it).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.checkpoint import load_tokenizer
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.engine.core_client import InprocClient
from slotserve.engine.llm_engine import LLMEngine
from slotserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.gemma

NEW_TOKENS = 32
# float32 on both sides, but different kernels (dequantization, attention, matmul blocking):
# the sampled tokens' logprobs agree to 3e-5 or better here; this bound leaves room.
LOGPROB_TOL = 1e-3
LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 40))  # 642 tokens
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    LONG,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
# The batched run: the top 5 logprobs too, which test_gemma_kv_dtype.py reads at divergences.
BATCHED = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def prompt_ids(gemma: Path) -> list[list[int]]:
    tok = load_tokenizer(gemma)
    ids = [tok.encode(p) for p in PROMPTS]
    assert len(ids[-1]) > 600  # well past the 512-token window
    return ids


@pytest.fixture(scope="module")
def hf_reference(gemma: Path, prompt_ids: list[list[int]],
                 gguf_parsed_once: Callable[[], AbstractContextManager[None]]
                 ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gemma.parent), gguf_file=gemma.name,
                                                     dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(gen.logits, tokens, strict=True)]
            out.append((tokens, logprobs))
    del model
    gc.collect()
    return out


def make_llm(gemma: Path, loaded: tuple[Any, Any, Any], **kwargs: Any) -> LLM:
    """An engine over the shared model: the real scheduler, runner and front end."""
    model, cfg, tokenizer = loaded
    kwargs.setdefault("max_model_len", 1024)
    args = EngineArgs.from_kwargs(model=str(gemma), dtype="float32", device="cpu", check=True,
                                  seed=0, **kwargs)
    config = args.create_engine_config(cfg.max_position_embeddings, kwargs["num_blocks"])
    runner = ModelRunner((model, cfg), config.scheduler_config, config.cache_config,
                         dtype="float32", device="cpu", seed=args.seed)
    return LLM(llm_engine=LLMEngine(InprocClient(EngineCore(config, runner)), tokenizer, cfg))


def batched_run(gemma: Path, loaded: tuple[Any, Any, Any], kv_cache_dtype: str
                ) -> tuple[LLM, list[Any]]:
    """PROMPTS in one batch on a fresh engine with the KV cache in `kv_cache_dtype`, every
    layer reading it through the native decode kernel. In float32 this is the package's
    `float32_run` (tests/checkpoint/conftest.py), run once: the batched run this module holds
    to transformers and the reference test_gemma_kv_dtype.py holds the 16- and 8-bit caches
    to."""
    llm = make_llm(gemma, loaded, num_blocks=160, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.native_decode
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    return llm, llm.generate(PROMPTS, BATCHED, use_tqdm=False)


def check(outs: list[Any], reference: list[tuple[list[int], list[float]]]) -> float:
    """Tokens equal, logprobs within LOGPROB_TOL; returns the largest logprob difference."""
    worst = 0.0
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, reference, strict=True)):
        ours = out.outputs[0]
        assert ours.token_ids == tokens, f"prompt {i} diverged"
        for entry, tok, ref in zip(ours.logprobs, tokens, logprobs, strict=True):
            worst = max(worst, abs(entry[tok] - ref))
    print(f"largest logprob difference from transformers: {worst:.2e}")
    assert worst < LOGPROB_TOL
    return worst


def test_one_by_one_then_batched_then_prefix_hits(gemma: Path, loaded: tuple[Any, Any, Any],
                                                  prompt_ids: list[list[int]],
                                                  hf_reference: list[Any],
                                                  float32_run: SimpleNamespace) -> None:
    llm = make_llm(gemma, loaded, num_blocks=512)
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in inputs]
    check(singles, hf_reference)
    # Batched on a fresh engine (batched_run, shared with test_gemma_kv_dtype.py): the same
    # prompt ids, and a fresh cache: nothing to hit.
    batched = float32_run.outputs
    assert [o.prompt_token_ids for o in batched] == prompt_ids
    check(batched, hf_reference)
    assert float32_run.prefix_cache_hits == 0
    # Batched again on the engine that ran them one by one: every prompt from its cache.
    again = llm.generate(inputs, GREEDY, use_tqdm=False)
    check(again, hf_reference)
    # Every prompt but the shortest ones came back from the cache (all but the last token).
    assert all(o.num_cached_tokens >= 16 * ((len(ids) - 1) // 16)
               for o, ids in zip(again, prompt_ids, strict=True))
    assert again[-1].num_cached_tokens > 512


def test_chunked_prefill_under_a_small_budget(gemma: Path, loaded: tuple[Any, Any, Any],
                                              prompt_ids: list[list[int]],
                                              hf_reference: list[Any]) -> None:
    llm = make_llm(gemma, loaded, num_blocks=512, max_num_batched_tokens=64, max_num_seqs=8,
                   enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY,
                        use_tqdm=False)
    check(outs, hf_reference)


def test_forced_preemption(gemma: Path, loaded: tuple[Any, Any, Any],
                           prompt_ids: list[list[int]], hf_reference: list[Any]) -> None:
    # 47 usable blocks of 16 tokens. The long prompt goes first and takes 41 for its prefill
    # (43 with its outputs); the short ones fill the rest, and as everyone's outputs grow,
    # the latest admitted are preempted and recomputed.
    order = [len(PROMPTS) - 1, *range(len(PROMPTS) - 1)]
    llm = make_llm(gemma, loaded, num_blocks=48, block_size=16, max_model_len=752,
                   enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in order], GREEDY,
                        use_tqdm=False)
    preemptions = llm.get_stats().num_preemptions
    print(f"preemptions: {preemptions}")
    assert preemptions > 0
    check(outs, [hf_reference[i] for i in order])
