"""Greedy with speculation equals greedy without, token for token, on the tiny random models:
one by one, batched, under a small token budget, with prefix-cache hits and under forced
preemption (the checker on throughout). Speculation is forced on (adaptive off) so every
step that finds a proposal verifies it."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from slotserve.check.checker import InvariantChecker
from slotserve.check.observer import SchedulerObserver
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams
from slotserve.spec_decode.config import SpeculativeConfig
from slotserve.worker.model_runner import ModelRunner
from tests.tiny_models import TinyModel

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5, "adaptive": False}


def copy_prompts(vocab: int, n: int = 8) -> list[list[int]]:
    """Prompts that repeat a passage (copy-friendly) and random ones; four share a prefix."""
    rng = random.Random(1)
    out = []
    shared = [rng.randrange(3, vocab) for _ in range(32)]
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 30))]
        p = body + body[: len(body) // 2] if i % 2 == 0 else body
        out.append(shared + p if i < 4 else p)
    return out


def run(path: str, prompts: list[list[int]], spec: dict[str, Any] | None,
        **kwargs: Any) -> tuple[list[list[int]], Any]:
    kwargs.setdefault("num_blocks", 160)
    llm = LLM(path, dtype="float32", device="cpu", check=True, speculative_config=spec,
              **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    stats = llm.llm_engine.engine_core.engine_core.scheduler.make_stats()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": 1},
    {},
    {"max_num_batched_tokens": 8},
    {"num_blocks": 12, "block_size": 8},
], ids=["one-by-one", "batched", "budget-8", "preemption"])
def test_ngram_greedy_equal(tiny_llama: SimpleNamespace, kwargs: dict[str, Any]) -> None:
    prompts = copy_prompts(300)
    ref, _ = run(tiny_llama.path, prompts, None, **kwargs)
    got, stats = run(tiny_llama.path, prompts, NGRAM, **kwargs)
    assert got == ref
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if "block_size" in kwargs:
        assert stats.num_preemptions > 0


def run_core(path: str, prompts: list[list[int]], spec: dict[str, Any] | None
             ) -> tuple[list[list[int]], Any]:
    """The real scheduler and model runner in a loop, the checker on every step (the tiny
    architectures come without a tokenizer)."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                         speculative_config=SpeculativeConfig.from_any(spec))
    cc = CacheConfig(block_size=4, num_blocks=256)
    sched = Scheduler(sc, cc)
    observer = SchedulerObserver(sched, InvariantChecker(sched))
    runner = ModelRunner(path, sc, cc, dtype="float32", device="cpu")
    for i, p in enumerate(prompts):
        observer.add_request(Request(f"r{i}", p, GREEDY))
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_requests():
        so = observer.schedule()
        for o in observer.update_from_output(so, runner.execute_model(so)):
            outs[o.request_id] += o.new_token_ids
    return [outs[f"r{i}"] for i in range(len(prompts))], sched.make_stats()


def test_suffix_greedy_equal_every_architecture(tiny_model: TinyModel) -> None:
    prompts = copy_prompts(300, 6)
    ref, _ = run_core(str(tiny_model.path), prompts, None)
    got, stats = run_core(str(tiny_model.path), prompts, SUFFIX)
    assert got == ref
    assert stats.spec_decode_num_accepted_tokens > 0


def test_penalties_logprobs_stops_act_on_accepted_tokens(tiny_llama: SimpleNamespace) -> None:
    """Penalties and min_tokens see the drafts before each position as outputs; logprobs
    come for each kept token; a stop token among accepted drafts ends the request there."""
    prompts = copy_prompts(300)
    ref_llm = LLM(tiny_llama.path, dtype="float32", device="cpu", check=True, num_blocks=160)
    spec_llm = LLM(tiny_llama.path, dtype="float32", device="cpu", check=True, num_blocks=160,
                   speculative_config=NGRAM)
    plain = ref_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    # A token each greedy output produces mid-way becomes a stop token (with min_tokens).
    stop = [o.outputs[0].token_ids[NEW // 2] for o in plain]
    for extra in ({"repetition_penalty": 1.3, "logprobs": 2},
                  {"frequency_penalty": 0.4, "presence_penalty": 0.2, "logprobs": 0},
                  {"min_tokens": 6}):
        params = [SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[s],
                                 **extra) for s in stop]  # type: ignore[arg-type]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        ref = ref_llm.generate(inputs, params)
        got = spec_llm.generate(inputs, params)
        for a, b in zip(ref, got, strict=True):
            ra, rb = a.outputs[0], b.outputs[0]
            assert rb.token_ids == ra.token_ids and rb.finish_reason == ra.finish_reason
            if ra.logprobs is not None:
                assert rb.logprobs is not None and len(rb.logprobs) == len(rb.token_ids)
                for ea, eb in zip(ra.logprobs, rb.logprobs, strict=True):
                    assert ea.keys() == eb.keys()
                    assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)
    stats = spec_llm.llm_engine.engine_core.engine_core.scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
