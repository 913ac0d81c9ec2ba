"""Structured outputs through the engine, over the fake runner (which samples only what each
request's bitmask allows): real llguidance grammars, the real scheduler, the checker on
every step, and its rule that every grammar consumed exactly the tokens its request kept.

Covered: chunked prefill, preemption with recompute, reset_prefix_cache with running
requests, aborts (also while a grammar compiles), streaming sessions whose grammar spans
chunks (the fold drops the last sampled token and the grammar forgets it too), a request
that waits for its grammar without holding a slot, and grammars that fail or time out.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from slotserve.check.trace import replay
from slotserve.core.request import RequestStatus
from slotserve.engine.llm_engine import LLMEngine
from slotserve.entrypoints.llm import LLM
from slotserve.errors import InvariantViolation, RequestValidationError
from slotserve.outputs import RequestOutput, RequestOutputKind
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_engine_fake import assert_idle, prompts_for
from tests.helpers import FakeEngineFactory, bounded

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["x", "yy", "zzz"]}}}}


def json_params(max_tokens: int = 60, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def core_of(engine: LLMEngine) -> Any:
    return engine.engine_core.engine_core  # type: ignore[attr-defined]


def check_json(out: RequestOutput) -> None:
    import jsonschema

    for c in out.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},
    {"num_blocks": 14, "block_size": 8},
    {"max_num_seqs": 2, "policy": "priority"},
], ids=["batched", "chunked16", "preempt", "few-slots"])
def test_constrained_outputs_do_not_depend_on_batching(fake_engine: FakeEngineFactory,
                                                      engine_kwargs: dict[str, Any]) -> None:
    prompts = prompts_for(10, seed=3)
    params = [json_params() if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=20)
              for i in range(len(prompts))]
    alone = [LLM(llm_engine=fake_engine()).generate(p, sp, use_tqdm=False)[0]
             for p, sp in zip(prompts, params, strict=True)]
    engine = fake_engine(**engine_kwargs)
    together = LLM(llm_engine=engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    finished = [o for o, p in zip(together, params, strict=True) if p.structured_outputs]
    assert sum(o.outputs[0].finish_reason == "stop" for o in finished) >= 4
    for o in finished:
        check_json(o)
    if engine_kwargs.get("num_blocks"):
        assert engine.get_stats().num_preemptions > 0
    assert_idle(engine)


def test_regex_choice_and_lark(fake_engine: FakeEngineFactory) -> None:
    llm = LLM(llm_engine=fake_engine())
    specs = [StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{1,3}"),
             StructuredOutputsParams(choice=["red", "green", "blue"]),
             StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/')]
    outs = llm.generate(prompts_for(3), [SamplingParams(max_tokens=40, temperature=0.0,
                                                        structured_outputs=s) for s in specs],
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[a-z]{2,4}-[0-9]{1,3}", texts[0])
    assert texts[1] in ("red", "green", "blue")
    assert outs[1].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)?", texts[2])


def test_reset_prefix_cache_with_running_grammars(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    for i, p in enumerate(prompts_for(4, seed=9)):
        engine.add_request(str(i), p, json_params())
    for _ in range(5):
        engine.step()
    assert engine.reset_prefix_cache(reset_running_requests=True)
    done: dict[str, RequestOutput] = {}
    for _ in bounded(engine.has_unfinished_requests):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.get_stats().num_preemptions >= 4
    for out in done.values():
        check_json(out)
    assert_idle(engine)


def test_abort_while_running_and_while_compiling(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    core = core_of(engine)
    engine.add_request("a", prompts_for(1)[0], json_params())
    engine.add_request("b", prompts_for(1, seed=1)[0], SamplingParams(max_tokens=8))
    engine.step()
    engine.abort_request("a")
    # Hold the compile thread so the next grammar has to wait.
    gate = threading.Event()
    core.structured_output_manager._compiler.submit(gate.wait)
    engine.add_request("c", prompts_for(1, seed=2)[0], SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{5}")))
    engine.step()
    assert core.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
    engine.abort_request("c")
    gate.set()
    outs: list[RequestOutput] = []
    for _ in bounded(engine.has_unfinished_requests):
        outs.extend(engine.step())
    assert {o.request_id for o in outs if o.finished} == {"b"}
    assert not core.scheduler.waiting_for_grammar
    assert_idle(engine)


def test_waiting_for_a_grammar_holds_no_slot(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(max_num_seqs=1)
    core = core_of(engine)
    gate = threading.Event()
    core.structured_output_manager._compiler.submit(gate.wait)
    engine.add_request("slow", prompts_for(1)[0], json_params())
    engine.add_request("free", prompts_for(1, seed=5)[0], SamplingParams(max_tokens=6))
    finished = []
    for _ in bounded(lambda: "free" not in finished):  # noqa: B023 (re-read every step)
        finished += [o.request_id for o in engine.step() if o.finished]
        # The one slot went to the free request; the other holds nothing while it waits.
        assert core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
        assert "slow" not in core.scheduler.slot_ledger.holders
        assert core.get_stats().num_waiting_for_grammar == 1
    gate.set()
    outs = []
    for _ in bounded(engine.has_unfinished_requests):
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["slow"]
    check_json(outs[0])
    assert_idle(engine)


def test_a_grammar_that_fails_fails_only_its_request(fake_engine: FakeEngineFactory) -> None:
    llm = LLM(llm_engine=fake_engine())
    # Valid Lark, but it names a special token this tokenizer does not have: only compiling
    # against the tokenizer (in the core) finds that.
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        grammar='start: "a" <|no_such_token|>'))
    with pytest.raises(RequestValidationError, match="no_such_token"):
        llm.generate(prompts_for(3), [SamplingParams(max_tokens=8), bad, json_params()],
                     use_tqdm=False)
    # The same grammar again fails at once (cached), and the engine goes on; each grammar
    # text was compiled once.
    with pytest.raises(RequestValidationError, match="no_such_token"):
        llm.generate(prompts_for(1), bad, use_tqdm=False)
    outs = llm.generate(prompts_for(2), json_params(), use_tqdm=False)
    assert all(o.finished for o in outs)
    assert llm.get_stats().num_grammars_compiled == 2
    assert_idle(llm.llm_engine)


def test_a_grammar_over_the_time_limit_is_refused(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine(grammar_compile_timeout_s=0.0)
    llm = LLM(llm_engine=engine)
    with pytest.raises(RequestValidationError, match="limit of 0 s"):
        llm.generate(prompts_for(1), json_params(), use_tqdm=False)
    out = llm.generate(prompts_for(1), SamplingParams(max_tokens=5), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert_idle(engine)


def test_bad_constraints_are_refused_up_front(fake_engine: FakeEngineFactory) -> None:
    llm = LLM(llm_engine=fake_engine())
    cases = [
        (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
        (StructuredOutputsParams(json='{"type": "object"'), "structured_outputs.json"),
        (StructuredOutputsParams(regex=r"(?=a)b"), "structured_outputs.regex"),
        (StructuredOutputsParams(regex=r"(a)\1"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for spec, param in cases:
        with pytest.raises(RequestValidationError) as info:
            llm.generate(prompts_for(1), SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert info.value.param == param, info.value
    with pytest.raises(RequestValidationError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(RequestValidationError) as info:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert info.value.param == "min_tokens"
    assert not core_of(llm.llm_engine).scheduler.requests


def test_session_grammar_spans_chunks(fake_engine: FakeEngineFactory) -> None:
    """A session's grammar constrains its whole output stream: each fold drops the last
    sampled token and the grammar rolls it back (the checker compares after every step), and
    the kept outputs of all chunks, joined, are one valid document."""
    engine = fake_engine()
    spec = StructuredOutputsParams(regex=r"([a-z]{3} ){2,40}")
    rid = "s"
    chunks = [(prompts_for(1)[0], SamplingParams(max_tokens=5, structured_outputs=spec)),
              ({"prompt_token_ids": [40, 41]}, SamplingParams(max_tokens=4)),
              ({"prompt_token_ids": []}, SamplingParams(max_tokens=4,
                                                        structured_outputs=spec)),
              ({"prompt_token_ids": [42]}, SamplingParams(max_tokens=30))]
    kept: list[int] = []
    for prompt, params in chunks:
        engine.add_request(rid, prompt, params, resumable=True,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        out = None
        for _ in bounded(lambda: out is None):  # noqa: B023 (re-read every step)
            out = next((o for o in engine.step() if o.outputs[0].finish_reason), None)
        tokens = out.outputs[0].token_ids
        kept.extend(tokens[:-1])  # the fold keeps all but the last sampled token
        last = tokens[-1:]
    text = engine.tokenizer.decode(kept + last)
    assert re.fullmatch(r"([a-z]{3} )*[a-z ]*", text), text
    engine.add_request(rid, {"prompt_token_ids": []}, None)
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert_idle(engine)


def test_a_session_cannot_change_its_grammar(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    engine.add_request("s", prompts_for(1)[0], SamplingParams(
        max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
        resumable=True)
    with pytest.raises(RequestValidationError, match="first chunk"):
        engine.add_request("s", {"prompt_token_ids": [5]}, SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[0-9]+")), resumable=True)
    with pytest.raises(RequestValidationError, match="min_tokens"):
        engine.add_request("s", {"prompt_token_ids": [5]}, SamplingParams(min_tokens=1),
                           resumable=True)
    engine.abort_request("s")
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert_idle(engine)


def test_checker_catches_a_grammar_out_of_step(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    engine.add_request("a", prompts_for(1)[0], json_params())
    engine.step()
    engine.step()
    grammar = core_of(engine).scheduler.requests["a"].structured_output_request.grammar
    grammar.rollback(1)  # as a fold that forgot the dropped token, or a lost update, would
    with pytest.raises(InvariantViolation, match=r"\[grammar\]"):
        engine.step()


def test_a_trace_replays_grammar_stops_and_folds(fake_engine: FakeEngineFactory,
                                                tmp_path: Path) -> None:
    """The replay has no grammar library: the trace tells it where each grammar completed,
    and the replayed scheduler makes the same outputs, checker on."""
    path = tmp_path / "trace.jsonl"
    engine = fake_engine(trace_path=str(path), num_blocks=14, block_size=8)
    for i, p in enumerate(prompts_for(5, seed=4)):
        engine.add_request(str(i), p, json_params(40))
    engine.add_request("s", prompts_for(1)[0], SamplingParams(
        max_tokens=3, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
        resumable=True)
    stops = 0
    for _ in bounded(engine.has_unfinished_requests):
        stops += sum(o.outputs[0].finish_reason == "stop" for o in engine.step())
    engine.add_request("s", {"prompt_token_ids": [7]}, SamplingParams(max_tokens=3),
                       resumable=True)
    engine.add_request("s", {"prompt_token_ids": []}, None)
    for _ in bounded(engine.has_unfinished_requests):
        stops += sum(o.outputs[0].finish_reason == "stop" for o in engine.step())
    assert stops >= 4 and engine.get_stats().num_preemptions > 0
    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    assert any(e["event"] == "grammar" and e["completed"] for e in recorded)
    replayed, outs = replay(str(path))
    assert not replayed.requests
    finished = set().union(*(o.finished_req_ids for o in outs))
    assert finished == {"0", "1", "2", "3", "4", "s"}
    # Without the recorded outcomes the replay could not know where grammars completed:
    # requests that stopped there would run on.
    blind = tmp_path / "blind.jsonl"
    blind.write_text("".join(json.dumps(e) + "\n" for e in recorded if e["event"] != "grammar"))
    assert replay(str(blind))[0].requests


def test_a_trace_replays_a_grammar_wait(fake_engine: FakeEngineFactory, tmp_path: Path) -> None:
    """A request waits for its grammar in the scheduler while another runs; the trace records
    the call that found it compiled, so the replay lets it in at the same step."""
    path = tmp_path / "trace.jsonl"
    engine = fake_engine(trace_path=str(path))
    gate = threading.Event()
    core_of(engine).structured_output_manager._compiler.submit(gate.wait)
    engine.add_request("slow", prompts_for(1)[0], json_params(20))
    engine.add_request("free", prompts_for(1, seed=5)[0], SamplingParams(max_tokens=6))
    for _ in range(3):
        engine.step()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    replayed, outs = replay(str(path))
    assert not replayed.requests
    first = next(i for i, o in enumerate(outs) if "slow" in o.num_scheduled_tokens)
    assert first >= 3 and "free" in outs[0].num_scheduled_tokens
    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["ids"] for e in recorded if e["event"] == "ready"] == [{"slow": None}]
