"""`--kv-cache-dtype`: the KV cache in float32, bfloat16, float16 or int8 (llama.cpp's q8_0:
a float16 scale per 32 values of a head), through the real engine on tiny models.

The same `kv_cache_memory` buys 2x the blocks in 16 bits and ~3.8x in int8 (the scales cost
2 bytes per 32 values), and the allocated bytes per token shrink alike; greedy output
follows the float32 cache's except where float32 itself had a near tie; the native decode
kernel reads each storage like the torch reference path; an unknown name is a ConfigError
(and an argparse error on the command line). The real Gemma file's run is in
tests/checkpoint/test_gemma_kv_dtype.py.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.engine.args import EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.entrypoints.cli import add_engine_arguments, engine_kwargs_from_args
from slotserve.errors import ConfigError
from slotserve.model_config import ModelConfig
from slotserve.worker.kv_cache import block_bytes, determine_num_blocks
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import ManualScheduler, TinyModel
from tests.models.test_model_hf_equivalence import make_prompts

CPU = torch.device("cpu")
DTYPES = ["float32", "bfloat16", "float16", "int8"]
NEW_TOKENS = 16


def follows_reference(ref: Any, got: Any, margin: float) -> tuple[int, float] | None:
    """Asserts `got`'s tokens equal `ref`'s up to the first divergence, and that there the
    reference had a near tie: the token `got` chose was within `margin` nats of the one the
    reference chose (both in the reference's top logprobs). Returns (that step, the gap), or
    None when the tokens are all equal."""
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
        if a != b:
            top = ref.logprobs[i]
            assert b in top, f"step {i}: {b} is not among the reference's top tokens {top}"
            gap = top[a] - top[b]
            assert gap < margin, f"step {i}: no near tie ({gap:.3f} nats)"
            return i, gap
    return None


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32"):
        EngineArgs.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(num_blocks=8, cache_dtype="int4")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])
    args = parser.parse_args(["--kv-cache-dtype", "int8"])
    assert EngineArgs.from_kwargs(**engine_kwargs_from_args(args)).kv_cache_dtype == "int8"


@pytest.mark.parametrize("head_dim", [256, 64])
def test_same_budget_holds_two_and_four_times_the_tokens(head_dim: int) -> None:
    cfg = ModelConfig(architecture="Gemma3ForCausalLM", model_type="gemma3_text",
                      hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=head_dim, intermediate_size=2048,
                      vocab_size=1000)
    budget = 100 * block_bytes(cfg, 16, torch.float32)
    blocks = {name: determine_num_blocks(cfg, 16, dtype, CPU, None, budget, 1, 1024)
              for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                  ("float16", torch.float16), ("int8", torch.int8)]}
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["float32"]
    # int8: head_dim bytes and a 2-byte scale per 32 where float32 takes 4 * head_dim bytes.
    row = head_dim + head_dim // 16
    assert blocks["int8"] == budget // (2 * 18 * 16 * row)
    assert blocks["int8"] / blocks["float32"] >= 4 * head_dim / row - 0.01 >= 3.75


def run(model: Any, kv_cache_dtype: str, **kwargs: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(model.path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype,
              max_model_len=96, block_size=4, check=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    gen = torch.Generator().manual_seed(1)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()}
               for n in (1, 5, 12, 30, 47)]
    return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama: Any) -> list[Any]:
    return run(tiny_llama, "float32")[1]


@pytest.mark.parametrize("kv_cache_dtype", DTYPES[1:])
def test_engine_follows_the_float32_cache(tiny_llama: Any, reference: list[Any],
                                          kv_cache_dtype: str) -> None:
    llm, outs = run(tiny_llama, kv_cache_dtype, kv_cache_memory=1 << 20)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert runner.memory.kv_cache_bytes <= 1 << 20
    # 16 bits: near ties only; int8 moves logprobs more in this random tiny model.
    margin = 0.05 if kv_cache_dtype != "int8" else 0.3
    diverged = [follows_reference(r, g, margin) for r, g in zip(reference, outs, strict=True)]
    assert diverged.count(None) >= len(outs) - 2, diverged


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
def test_native_kernel_reads_each_storage_as_the_reference(
        tiny_models: dict[str, TinyModel], kv_cache_dtype: str) -> None:
    """Gemma 3 (a sliding window, q/k norms) through the real runner: the native decode
    kernel and fused ops against the torch path over the same storage type give the same
    tokens, logprobs within rounding (in 16 and 8 bits a rounding difference before the
    store can move a stored value by one step, which this tiny model amplifies)."""
    results = []
    for native in (True, False):
        runner = ModelRunner(tiny_models["gemma3"].path,
                             SchedulerConfig(max_num_seqs=8, max_model_len=128),
                             CacheConfig(block_size=4, num_blocks=512,
                                         cache_dtype=kv_cache_dtype),
                             dtype="float32", device="cpu", native_attention=native)
        assert runner.native_decode == native
        sched = ManualScheduler(block_size=4)
        params = SamplingParams(temperature=0.0, logprobs=1, max_tokens=NEW_TOKENS)
        for i, prompt in enumerate(make_prompts()):
            sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
        sched.run(runner, chunk=5)
        results.append(sched.requests)
    tol = 1e-3 if kv_cache_dtype == "float32" else 2e-2
    for rid, a in results[0].items():
        b = results[1][rid]
        assert a.outputs == b.outputs, rid
        for ea, eb, tok in zip(a.logprobs, b.logprobs, a.outputs, strict=True):
            assert abs(ea[tok] - eb[tok]) < tol


def test_bytes_per_token(tiny_models: dict[str, TinyModel]) -> None:
    """What the runner allocates per token: half of float32's in 16 bits, (D + D / 16) / 4D
    in int8 (a float16 scale per 32 values)."""
    per_token = {}
    for name in DTYPES:
        args = EngineArgs.from_kwargs(model=tiny_models["qwen3"].path, dtype="float32",
                                      device="cpu", kv_cache_dtype=name, num_blocks=33,
                                      block_size=4, max_model_len=64)
        runner = EngineCore.from_engine_args(args).model_runner
        assert isinstance(runner, ModelRunner)
        per_token[name] = runner.memory.kv_cache_bytes / (33 * 4)
    cfg = ModelConfig.from_pretrained(tiny_models["qwen3"].path)
    d = cfg.head_dim
    assert per_token["bfloat16"] == per_token["float16"] == per_token["float32"] / 2
    assert d % 32 == 0
    assert per_token["int8"] == per_token["float32"] * (d + d // 16) / (4 * d)
