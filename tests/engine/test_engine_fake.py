"""Engine plumbing over the real scheduler and a fake, torch-free model runner.

The fake's next token hashes the whole context the worker holds, so equal outputs across
batch compositions, chunking, preemption and cache resets mean the worker saw the same
contexts. The invariant checker runs on every step (check=True).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from slotserve.engine.llm_engine import LLMEngine
from slotserve.entrypoints.llm import LLM
from slotserve.errors import EngineDeadError, RequestValidationError
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams
from tests.helpers import TOKENIZER_EOS as EOS, FakeEngineFactory, bounded


def prompts_for(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(engine: LLMEngine) -> None:
    sched = engine.engine_core.engine_core.scheduler
    assert not engine.has_unfinished_requests()
    assert not sched.requests and len(engine.engine_core.engine_core.model_runner.slots) == 0
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_generate_in_order_with_text_and_metrics(fake_engine: FakeEngineFactory,
                                                 tokenizer: Any) -> None:
    llm = LLM(llm_engine=fake_engine())
    prompts = ["To be, or not", {"prompt_token_ids": [5, 6, 7]}, "Now is the winter"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["To be, or not", None, "Now is the winter"]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is None and c.cumulative_logprob is None
        m = o.metrics
        assert m is not None and m.num_generation_tokens == len(c.token_ids)
        assert m.num_prompt_tokens == len(o.prompt_token_ids)
        assert (m.arrival_time <= m.first_scheduled_time <= m.first_token_time
                <= m.last_token_time <= m.finished_time)
        assert len(m.token_times) == len(c.token_ids)
    stats = llm.get_stats()
    assert stats.generation_tokens_total == sum(len(t) for t in token_ids(outs))
    assert stats.prompt_tokens_total == sum(len(o.prompt_token_ids) for o in outs)
    assert_idle(llm.llm_engine)


def alone(factory: FakeEngineFactory, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    llm = LLM(llm_engine=factory())
    return [token_ids(llm.generate(p, params, use_tqdm=False))[0] for p in prompts]


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},
    {"num_blocks": 20, "block_size": 8},
    {"max_num_seqs": 3, "policy": "priority"},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 7, "long_prefill_token_threshold": 5},
], ids=["batched", "chunked16", "preempt", "few-slots", "no-cache-threshold"])
def test_outputs_do_not_depend_on_batching(fake_engine: FakeEngineFactory,
                                           engine_kwargs: dict[str, Any]) -> None:
    prompts = prompts_for(16)
    expected = alone(fake_engine, prompts, GREEDY)
    engine = fake_engine(**engine_kwargs)
    outs = LLM(llm_engine=engine).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected
    if "num_blocks" in engine_kwargs:
        assert engine.get_stats().num_preemptions > 0
    assert_idle(engine)


def test_shared_prefix_hits_the_cache(fake_engine: FakeEngineFactory) -> None:
    prefix = list(range(10, 58))
    prompts = [{"prompt_token_ids": prefix + [100 + i, 7]} for i in range(8)]
    expected = alone(fake_engine, prompts, GREEDY)
    engine = fake_engine()
    outs = LLM(llm_engine=engine).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 7 * 48 and stats.prefix_cache_queries > 0
    assert max(o.num_cached_tokens for o in outs) == 48


def test_reset_prefix_cache_with_running_requests(fake_engine: FakeEngineFactory) -> None:
    prompts = prompts_for(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = alone(fake_engine, prompts, params)
    engine = fake_engine(max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals: dict[str, RequestOutput] = {}
    for step in bounded(engine.has_unfinished_requests):
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        if step + 1 in (3, 9):
            assert engine.reset_prefix_cache(reset_running_requests=True)
    assert [finals[str(i)].outputs[0].token_ids for i in range(6)] == expected
    assert engine.get_stats().num_preemptions >= 6
    assert_idle(engine)


def find_text_stop(fake_engine: FakeEngineFactory, prompt: Any) -> tuple[str, str]:
    text = LLM(llm_engine=fake_engine()).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    assert len(text) > 12
    return text, text[6:9]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_finishes_and_releases(fake_engine: FakeEngineFactory, include: bool) -> None:
    prompt = {"prompt_token_ids": [11, 12, 13, 14]}
    full, stop = find_text_stop(fake_engine, prompt)
    engine = fake_engine()
    llm = LLM(llm_engine=engine)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    others = prompts_for(3, seed=9)
    outs = llm.generate([prompt, *others], params, use_tqdm=False)
    c = outs[0].outputs[0]
    cut = full.index(stop) + (len(stop) if include else 0)
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, full[:cut])
    assert len(c.token_ids) < 30
    assert_idle(engine)  # the engine core released its blocks and slot


def test_n_greater_than_one(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, logprobs=2)
    (out,) = LLM(llm_engine=engine).generate({"prompt_token_ids": list(range(5, 45))}, params,
                                             use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.finish_reason is not None and c.logprobs is not None
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in entry for t, entry in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob == pytest.approx(-0.25 * len(c.token_ids))
    assert out.metrics is not None
    assert out.metrics.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs)
    # The three sequences share the prompt's KV through the prefix cache.
    assert engine.get_stats().prefix_cache_hits > 0
    assert_idle(engine)


def test_min_tokens_holds_back_eos(fake_engine: FakeEngineFactory) -> None:
    # Find a prompt on which the fake model emits EOS early.
    llm = LLM(llm_engine=fake_engine())
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for prompt in prompts_for(200, seed=1):
        c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        if c.finish_reason == "stop" and len(c.token_ids) < 30:
            break
    else:
        pytest.skip("no early EOS found")
    assert c.token_ids[-1] == EOS
    n = len(c.token_ids)
    c2 = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n + 2),
                      use_tqdm=False)[0].outputs[0]
    assert len(c2.token_ids) >= n + 2 and c2.token_ids[:n - 1] == c.token_ids[:n - 1]


def test_delta_outputs_add_up(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    engine.add_request("d", "To be, or not", SamplingParams(max_tokens=20, temperature=0.0),
                       output_kind=RequestOutputKind.DELTA)
    engine.add_request("c", "To be, or not", SamplingParams(max_tokens=20, temperature=0.0))
    text, tokens, final = "", [], None
    for _ in bounded(engine.has_unfinished_requests):
        for o in engine.step():
            if o.request_id == "d":
                text += o.outputs[0].text
                tokens += o.outputs[0].token_ids
            elif o.finished:
                final = o
    assert final is not None
    assert (text, tokens) == (final.outputs[0].text, final.outputs[0].token_ids)


def test_abort_keeps_others_running(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), prompts_for(4)[i], params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["1", "2"])
    finished = set()
    for _ in bounded(engine.has_unfinished_requests):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"0", "3"}
    assert_idle(engine)


def test_bad_requests_change_nothing(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("ok", "To be", params)
    engine.step()
    bad = [
        ("long", {"prompt_token_ids": [5] * 64}, params),
        ("ok", "To be", params),  # duplicate id
        ("vocab", {"prompt_token_ids": [10**6]}, params),
        ("n", "x", SamplingParams(n=2, stop="a")),  # fine on its own ...
    ]
    for rid, prompt, p in bad[:3]:
        with pytest.raises(RequestValidationError):
            engine.add_request(rid, prompt, p)
    assert set(engine.engine_core.engine_core.scheduler.requests) == {"ok"}
    outs = [o for _ in range(20) for o in engine.step()]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
    # LLM.generate validates every prompt before submitting any.
    llm = LLM(llm_engine=engine)
    with pytest.raises(RequestValidationError, match="prompt 1"):
        llm.generate(["a", {"prompt_token_ids": [5] * 64}], params, use_tqdm=False)
    assert not engine.engine_core.engine_core.scheduler.requests and not engine.output_processor.groups


def test_forward_failure_fails_that_step_only(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(fail_on_step=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", "To be", params)
    engine.add_request("b", "Now is", params)
    outs = [o for _ in range(3) for o in engine.step()]
    errors = {o.request_id for o in outs if o.finished}
    assert errors == {"a", "b"}
    assert all(o.outputs[0].finish_reason == "error" for o in outs if o.finished)
    assert isinstance(engine.last_error, RuntimeError)
    assert engine.get_stats().num_failed_steps == 1
    # The engine keeps serving new requests.
    engine.add_request("c", "To be", params)
    finals = [o for _ in range(30) for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("c", "length")]
    assert_idle(engine)
    # The offline API raises instead of returning half-failed results.
    llm = LLM(llm_engine=fake_engine(fail_on_step=2))
    with pytest.raises(EngineDeadError):
        llm.generate(["To be", "Now is"], params, use_tqdm=False)
    assert not llm.llm_engine.output_processor.groups


def test_streaming_session_chunks(fake_engine: FakeEngineFactory) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    p1, p2, p3 = [20, 21, 22, 23, 24], [30, 31, 32], [40]
    engine = fake_engine(block_size=4)
    engine.add_request("s", {"prompt_token_ids": p1}, params, resumable=True)
    chunks: list[RequestOutput] = []
    engine.add_request("other", "To be", SamplingParams(max_tokens=12, ignore_eos=True))
    queued = False
    for _ in bounded(engine.has_unfinished_requests):
        for o in engine.step():
            if o.request_id == "s" and o.outputs[0].finish_reason is not None:
                chunks.append(o)
        if not queued:  # the second chunk arrives while the first still runs
            engine.add_request("s", {"prompt_token_ids": p2}, params, resumable=True)
            queued = True
    assert len(chunks) == 2 and not any(c.finished for c in chunks)
    engine.add_request("s", {"prompt_token_ids": p3}, params, resumable=True)  # while paused
    for _ in bounded(engine.has_unfinished_requests):
        chunks += [o for o in engine.step()
                   if o.request_id == "s" and o.outputs[0].finish_reason is not None]
    engine.add_request("s", {"prompt_token_ids": [0]}, None)  # end of session
    end = [o for o in engine.step() if o.request_id == "s"]
    assert len(end) == 1 and end[0].finished
    assert_idle(engine)
    # Each chunk continues from all earlier chunks and outputs, minus each chunk's last token.
    out1, out2, out3 = (c.outputs[0].token_ids for c in chunks)
    ctx2 = p1 + out1[:-1] + p2
    ctx3 = ctx2 + out2[:-1] + p3
    expected = alone(fake_engine, [{"prompt_token_ids": ctx2}, {"prompt_token_ids": ctx3}],
                     params)
    assert [out2, out3] == expected


def test_idle_session_times_out(fake_engine: FakeEngineFactory) -> None:
    import time

    engine = fake_engine(streaming_session_timeout_s=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, params, resumable=True)
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert engine.get_stats().num_paused_sessions == 1
    time.sleep(1.1)  # the scheduler looks for idle sessions at most once a second
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].finish_message and "idle" in out.outputs[0].finish_message
    engine.step()  # delivers the slot release
    assert_idle(engine)


def test_session_ended_while_running(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, params, resumable=True)
    engine.step()
    engine.add_request("s", {"prompt_token_ids": [0]}, None)  # end mark, queued
    outs = []
    for _ in bounded(engine.has_unfinished_requests):
        outs += [o for o in engine.step() if o.request_id == "s"]
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 4
    assert not any(o.finished for o in outs[:-1])
    assert_idle(engine)
