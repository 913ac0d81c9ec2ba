"""slotserve's runner against Hugging Face transformers on tiny random models.

Greedy tokens must be identical and sampled-token logprobs within 1e-4 (Gemma 3: 1e-3), whether
the prompts are prefilled whole, in chunks (later chunks attend to a cached prefix) or in steps
that mix chunked prefills with decodes. Gemma 3's prompts run far past its 6-token window.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.models import attention
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import (
    VOCAB,
    ManualScheduler,
    TinyModel,
    build_tiny,
    hf_greedy,
    require_compiler,
)

NEW_TOKENS = 32
PROMPT_LENS = [1, 3, 7, 12, 17, 24, 33, 45]
# Gemma's prefill hidden states equal transformers' bit for bit; in decode steps the two
# attention reductions round differently (~1e-7), and its four norms per layer with scales
# near 4 in the tiny model amplify that to a few 1e-4 in the logprobs. A window or RoPE error
# moves them by 0.1 or more.
LOGPROB_TOL = {"gemma3": 1e-3}


def make_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


_native_runners: list[ModelRunner] = []


@pytest.fixture(autouse=True)
def native_decode_ran(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A runner asked for the native decode kernel (float32) must have chosen it and called it:
    a kernel that stops building fails here instead of quietly testing the torch path."""
    calls = [0]
    real = attention.paged_decode

    def counted(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "paged_decode", counted)
    _native_runners.clear()
    yield
    for runner in _native_runners:
        assert runner.native_decode, "native decode was asked for and not chosen"
    if _native_runners:
        assert calls[0] > 0, "the native decode kernel was chosen but never called"


def make_runner(model: TinyModel, block_size: int = 4, max_num_seqs: int = 8,
                max_model_len: int = 128, native: bool = True, dtype: str = "float32"
                ) -> ModelRunner:
    if native and dtype == "float32":
        require_compiler("the native decode kernel")
    runner = ModelRunner(model.path, SchedulerConfig(max_num_seqs=max_num_seqs,
                                                     max_model_len=max_model_len),
                         CacheConfig(block_size=block_size, num_blocks=512), dtype=dtype,
                         device="cpu", native_attention=native)
    if native and dtype == "float32":
        _native_runners.append(runner)
    else:
        assert not runner.native_decode
    return runner


@pytest.fixture(scope="module")
def hf_references(tiny_models: dict[str, TinyModel]) -> dict[str, list]:
    prompts = make_prompts()
    return {name: [hf_greedy(m.hf, p, NEW_TOKENS) for p in prompts]
            for name, m in tiny_models.items()}


def check_against_hf(sched: ManualScheduler, refs: list, num_logprobs: int,
                     tol: float = 1e-4) -> None:
    for i, (hf_tokens, hf_logprobs) in enumerate(refs):
        req = sched.requests[f"r{i}"]
        assert req.outputs == hf_tokens, f"prompt {i} ({PROMPT_LENS[i]} tokens) diverged"
        assert len(req.logprobs) == NEW_TOKENS
        for step, (tok, entry) in enumerate(zip(req.outputs, req.logprobs, strict=True)):
            ref = hf_logprobs[step]
            assert abs(entry[tok] - ref[tok].item()) < tol
            top = ref.topk(num_logprobs)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[t] - v) < tol
            assert all(isinstance(v, float) for v in entry.values())


@pytest.mark.parametrize("chunk", [None, 5])
def test_greedy_matches_hf(tiny_model: TinyModel, hf_references: dict[str, list],
                           chunk: int | None) -> None:
    runner = make_runner(tiny_model)
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(make_prompts()):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=chunk)
    check_against_hf(sched, hf_references[tiny_model.name], num_logprobs=3,
                     tol=LOGPROB_TOL.get(tiny_model.name, 1e-4))
    assert len(runner.slots) == 0


@pytest.mark.parametrize("name,native", [("llama", True), ("gemma3", True),
                                         ("gemma3", False)])
def test_mixed_step_prefix_chunk_with_decodes(tiny_models: dict[str, TinyModel],
                                              hf_references: dict[str, list], name: str,
                                              native: bool) -> None:
    """One request prefills a chunk after its cached prefix while the others decode (for
    Gemma 3 with either decode path, the chunks and contexts longer than its window)."""
    model = tiny_models[name]
    runner = make_runner(model, block_size=4, native=native)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=NEW_TOKENS)
    for i in (0, 1, 2):
        sched.add(f"r{i}", prompts[i], params, max_tokens=NEW_TOKENS)
    long = sched.add("r7", prompts[7], params, max_tokens=NEW_TOKENS)
    # Step 1: everyone's first chunk (the short prompts finish their prefill).
    out = runner.execute_model(sched.schedule(chunk=10))
    sched.update(out)
    assert out.sampled_token_ids[out.req_id_to_index["r7"]] == []
    # Steps 2..: r7 prefills 10 tokens at a time after its cached prefix, mixed with decodes.
    mixed_steps = 0
    while long.num_computed < len(long.prompt):
        so = sched.schedule(chunk=10)
        assert so.num_scheduled_tokens["r7"] > 1 and so.num_scheduled_tokens["r0"] == 1
        mixed_steps += 1
        sched.update(runner.execute_model(so))
    assert mixed_steps >= 3
    sched.run(runner, chunk=10)
    refs = hf_references[name]
    for i in (0, 1, 2, 7):
        assert sched.requests[f"r{i}"].outputs == refs[i][0]
        for tok, entry, ref in zip(sched.requests[f"r{i}"].outputs,
                                   sched.requests[f"r{i}"].logprobs, refs[i][1], strict=True):
            assert math.isclose(entry[tok], ref[tok].item(),
                                abs_tol=LOGPROB_TOL.get(name, 1e-4))


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_decode_after_preemption_recompute(tiny_models: dict[str, TinyModel],
                                           hf_references: dict[str, list], name: str) -> None:
    """A preempted request comes back with prompt + outputs as prefill and continues exactly."""
    model = tiny_models[name]
    runner = make_runner(model)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i in (3, 5):
        sched.add(f"r{i}", prompts[i], params, max_tokens=NEW_TOKENS)
    for _ in range(10):
        sched.update(runner.execute_model(sched.schedule()))
    sched.preempt("r5")
    sched.update(runner.execute_model(sched.schedule(only={"r3"})))
    assert "r5" not in runner.slots
    sched.run(runner, chunk=6)
    refs = hf_references[name]
    assert sched.requests["r3"].outputs == refs[3][0]
    assert sched.requests["r5"].outputs == refs[5][0]


def test_gemma3_torch_decode_path_with_block_larger_than_window(
        tiny_models: dict[str, TinyModel], hf_references: dict[str, list]) -> None:
    """The torch decode path (no native kernel) with 16-token blocks: each 6-token window
    starts inside the block that also holds the query, or in the one before it."""
    runner = make_runner(tiny_models["gemma3"], block_size=16, native=False)
    sched = ManualScheduler(block_size=16)
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(make_prompts()):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=7)
    check_against_hf(sched, hf_references["gemma3"], num_logprobs=3,
                     tol=LOGPROB_TOL["gemma3"])


def test_gemma3_bfloat16_prefill_equals_transformers_bit_for_bit(
        tiny_models: dict[str, TinyModel]) -> None:
    """In bfloat16, transformers scales by (1 + w) rounded as float32 from the bf16 weight and
    multiplies by sqrt(hidden) rounded to bf16: slotserve's whole-prompt logprobs equal its
    own exactly on a CPU with AVX-512 BF16. Without it torch's bfloat16 matmuls round by
    the shape (slotserve runs the 8 prompts as one batch, transformers one at a time): on an
    AMD Zen 3 one prompt of 8 came out 1e-6 off in every logprob, where a wrong scale moves
    them by 1e-3 and more. (Later decode steps may differ in the last bf16 bit, as any two
    attention implementations do.)"""
    from transformers import AutoModelForCausalLM

    cpuinfo = Path("/proc/cpuinfo")
    native_bf16 = cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text().split()
    model = tiny_models["gemma3"]
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.bfloat16).eval()
    runner = make_runner(model, dtype="bfloat16")
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, SamplingParams(temperature=0.0, logprobs=5, max_tokens=1),
                  max_tokens=1)
    sched.run(runner)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        entry = sched.requests[f"r{i}"].logprobs[0]
        assert sched.requests[f"r{i}"].outputs == [int(ref.argmax())]
        off = max(abs(v - ref[t].item()) for t, v in entry.items())
        assert off <= (0.0 if native_bf16 else 1e-5), f"prompt {i}: {off}"


def test_mistral_sliding_window_matches_hf(tmp_path: Path) -> None:
    """Mistral's window applies to every layer; prompts and outputs run past it."""
    model = build_tiny("mistral", tmp_path / "mistral_sw", seed=9, sliding_window=6)
    runner = make_runner(model)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()[4:]
    params = SamplingParams(temperature=0.0, logprobs=1, max_tokens=16)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=16)
    sched.run(runner, chunk=5)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = hf_greedy(model.hf, prompt, 16)
        assert sched.requests[f"r{i}"].outputs == tokens
        for tok, entry, ref in zip(tokens, sched.requests[f"r{i}"].logprobs, logprobs,
                                   strict=True):
            assert math.isclose(entry[tok], ref[tok].item(), abs_tol=1e-4)


def test_gemma3_final_logit_softcapping_matches_hf(tmp_path: Path) -> None:
    """Gemma 2's tanh cap on the logits, which Gemma 3 configs may still set."""
    model = build_tiny("gemma3", tmp_path / "gemma3_cap", seed=4, final_logit_softcapping=8.0)
    runner = make_runner(model)
    sched = ManualScheduler(block_size=4)
    prompts = make_prompts()[2:5]
    params = SamplingParams(temperature=0.0, logprobs=1, max_tokens=8)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=8)
    sched.run(runner)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = hf_greedy(model.hf, prompt, 8)
        assert sched.requests[f"r{i}"].outputs == tokens
        for tok, entry, ref in zip(tokens, sched.requests[f"r{i}"].logprobs, logprobs,
                                   strict=True):
            assert ref.max() - ref.min() < 16.001  # the cap keeps every logit within +-8
            assert math.isclose(entry[tok], ref[tok].item(), abs_tol=1e-4)
