"""The engine over the real ModelRunner on a tiny random Llama, checker on throughout.

Greedy outputs must be the same request by request as Hugging Face `generate`, however the
engine batches, chunks, caches, preempts or resets.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from slotserve.entrypoints.llm import LLM
from slotserve.errors import RequestValidationError
from slotserve.outputs import RequestOutput
from slotserve.sampling_params import SamplingParams
from tests.helpers import bounded, hf_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHARED_PREFIX = list(range(40, 80))  # 40 tokens: 2 full blocks of 16


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(12)]
    # Four share a prefix, for prefix-cache hits.
    prompts += [SHARED_PREFIX + [rng.randrange(3, 300) for _ in range(3 + i)] for i in range(4)]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def hf_refs(tiny_llama: SimpleNamespace) -> list[list[int]]:
    return [hf_greedy(tiny_llama.hf, p, NEW_TOKENS)[0] for p in PROMPTS]


def make_llm(tiny_llama: SimpleNamespace, **kwargs: Any) -> LLM:
    kwargs.setdefault("check", True)
    kwargs.setdefault("num_blocks", 128)
    return LLM(tiny_llama.path, dtype="float32", device="cpu", **kwargs)


def as_inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm: LLM) -> None:
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert not core.scheduler.requests and len(core.model_runner.slots) == 0
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},
    {"num_blocks": 14, "block_size": 8},
    {"max_num_seqs": 4, "policy": "priority", "enable_prefix_caching": False},
], ids=["16-together", "chunked-16", "preemption", "4-slots-priority"])
def test_greedy_matches_hf(tiny_llama: SimpleNamespace, hf_refs: list[list[int]],
                           engine_kwargs: dict[str, Any]) -> None:
    llm = make_llm(tiny_llama, **engine_kwargs)
    outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_refs
    stats = llm.get_stats()
    if engine_kwargs.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits >= 3 * 32  # three of the four shared-prefix prompts
    if "num_blocks" in engine_kwargs:
        assert stats.num_preemptions > 0
    assert stats.generation_tokens_total == len(PROMPTS) * NEW_TOKENS
    assert_idle(llm)


def test_reset_prefix_cache_mid_generation(tiny_llama: SimpleNamespace,
                                           hf_refs: list[list[int]]) -> None:
    llm = make_llm(tiny_llama, max_num_batched_tokens=64)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    finals: dict[str, RequestOutput] = {}
    for step in bounded(engine.has_unfinished_requests):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        if step + 1 in (2, 6, 10):
            assert engine.reset_prefix_cache(reset_running_requests=True)
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == hf_refs
    assert engine.get_stats().num_preemptions > 0
    assert_idle(llm)


def test_streaming_session_matches_hf(tiny_llama: SimpleNamespace) -> None:
    llm = make_llm(tiny_llama, block_size=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    chunks = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31]]
    engine.add_request("s", {"prompt_token_ids": chunks[0]}, params, resumable=True)
    engine.add_request("s", {"prompt_token_ids": chunks[1]}, params, resumable=True)
    engine.add_request("other", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    outs: list[list[int]] = []
    for _ in bounded(engine.has_unfinished_requests):
        outs += [o.outputs[0].token_ids for o in engine.step()
                 if o.request_id == "s" and o.outputs[0].finish_reason is not None]
    engine.add_request("s", {"prompt_token_ids": chunks[2]}, params, resumable=True)
    for _ in bounded(engine.has_unfinished_requests):
        outs += [o.outputs[0].token_ids for o in engine.step()
                 if o.request_id == "s" and o.outputs[0].finish_reason is not None]
    engine.add_request("s", {"prompt_token_ids": [0]}, None)
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert_idle(llm)
    context: list[int] = []
    for chunk, out in zip(chunks, outs, strict=True):
        context += chunk
        assert out == hf_greedy(tiny_llama.hf, context, 5)[0]
        context += out[:-1]  # the last sampled token of a chunk is never fed back


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: SimpleNamespace) -> None:
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    alone = tokens(llm.generate(prompt, params, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.7, max_tokens=5 + i, ignore_eos=True)
              for i in range(5)]
    mixed = llm.generate([*as_inputs(PROMPTS[3:8]), prompt], [*others, params],
                         use_tqdm=False)
    assert tokens(mixed)[-1] == alone
    # n > 1: sequence i is the request with seed + i.
    (fanned,) = llm.generate(prompt, params.clone(n=3), use_tqdm=False)
    for i, c in enumerate(fanned.outputs):
        single = llm.generate(prompt, params.clone(seed=1234 + i), use_tqdm=False)
        assert c.token_ids == single[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in fanned.outputs}) > 1
    assert_idle(llm)


def test_stop_strings_min_tokens_and_logprobs(tiny_llama: SimpleNamespace, tokenizer: Any) -> None:
    llm = make_llm(tiny_llama)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                               logprobs=3), use_tqdm=False)[0].outputs[0]
    assert free.logprobs is not None and len(free.logprobs) == 24
    for t, entry in zip(free.token_ids, free.logprobs, strict=True):
        assert t in entry and len(entry) >= 3 and all(v <= 0.0 for v in entry.values())
        assert entry[t] == max(entry.values())  # greedy picks the top token
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    c = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                            stop=stop), use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[:text.index(stop)] and len(c.token_ids) < 24
    # min_tokens: a stop token that greedy decoding reaches at position 3 is masked until 6.
    stop_tok = free.token_ids[2]
    early = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)
    assert early[0].outputs[0].token_ids[-1] == stop_tok
    assert len(early[0].outputs[0].token_ids) <= 3
    late = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=6,
                                               stop_token_ids=[stop_tok]), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) >= 6
    assert_idle(llm)


def test_chat_and_bad_input_while_serving(tiny_llama: SimpleNamespace) -> None:
    llm = make_llm(tiny_llama, max_model_len=64)
    (out,) = llm.chat([{"role": "user", "content": "To be, or not"}],
                      SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out.prompt == "<s>user: To be, or not\nassistant:"
    engine = llm.llm_engine
    engine.add_request("ok", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.step()
    with pytest.raises(RequestValidationError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 64}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestValidationError):
        llm.generate("x", SamplingParams(temperature=0.0, top_k=-5), use_tqdm=False)
    finals = []
    for _ in bounded(engine.has_unfinished_requests):
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["ok"]
    assert len(finals[0].outputs[0].token_ids) == NEW_TOKENS
    assert_idle(llm)
