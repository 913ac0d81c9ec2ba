"""The validation budget: a constraint too costly to check or to follow is refused before
llguidance sees it, at once and naming the field (a schema with too many properties or
subschemas, a regex whose every match needs more counted repetitions than the lexer may have
states); what fits is checked as before. And distinct hostile patterns leave the engine's
memory where it was (the CI-size version of benchmarks/grammar_memory.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from slotserve.entrypoints.llm import LLM
from slotserve.errors import RequestValidationError
from slotserve.memory import resident_bytes
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from slotserve.structured_output import grammar as grammar_module
from slotserve.structured_output.budget import (
    MAX_OBJECT_PROPERTIES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_NODES,
    check_regex_budget,
)
from slotserve.structured_output.grammar import checked_grammar
from tests.engine.test_engine_fake import assert_idle
from tests.helpers import FakeEngineFactory


def refused(spec: StructuredOutputsParams) -> RequestValidationError:
    start = time.monotonic()
    with pytest.raises(RequestValidationError) as info:
        checked_grammar(spec)
    assert time.monotonic() - start < 5  # llguidance would take 10 s to minutes
    return info.value


def test_too_many_properties_or_subschemas() -> None:
    props = {f"p{i}": {"type": "string"} for i in range(MAX_OBJECT_PROPERTIES + 1)}
    err = refused(StructuredOutputsParams(json={"type": "object", "properties": props}))
    assert err.param == "structured_outputs.json"
    assert f"{MAX_OBJECT_PROPERTIES + 1} properties" in str(err)
    wide: dict[str, Any] = {"anyOf": [{"type": "integer", "minimum": i}
                                      for i in range(MAX_SCHEMA_NODES + 1)]}
    assert "subschemas" in str(refused(StructuredOutputsParams(json=wide)))


def _object(num: int, required: int = 0) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(num)},
            "required": [f"p{i}" for i in range(required)]}


def test_too_many_optional_properties_refused_before_the_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,000 optional properties are within the property count but not what the engine's
    # compile can follow (test_grammar_limits): refused without any llguidance call.
    def no_library(*_: Any, **__: Any) -> str:
        raise AssertionError("the schema reached llguidance")

    monkeypatch.setattr(grammar_module, "json_schema_grammar", no_library)
    err = refused(StructuredOutputsParams(json=_object(MAX_OBJECT_PROPERTIES)))
    assert err.param == "structured_outputs.json"
    assert f"{MAX_OBJECT_PROPERTIES} optional properties" in str(err) and "required" in str(err)
    monkeypatch.undo()
    # As many properties, enough of them required: within the budget, checked as before.
    checked_grammar(StructuredOutputsParams(
        json=_object(MAX_OBJECT_PROPERTIES, MAX_OBJECT_PROPERTIES - MAX_OPTIONAL_PROPERTIES)))


def test_deep_schema_costs_no_stack() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(100_000):
        deep = {"type": "array", "items": deep}
    assert "subschemas" in str(refused(StructuredOutputsParams(json=deep)))


@pytest.mark.parametrize("pattern", ["^((a{100}){100}){100}$", "a{1000000}",
                                     "y(((a{50}){50}){50}|((b{50}){50}){50})"])
def test_counted_repetitions_past_the_lexer_limit(pattern: str) -> None:
    err = refused(StructuredOutputsParams(regex=pattern))
    assert err.param == "structured_outputs.regex" and "counted repetitions" in str(err)
    err = refused(StructuredOutputsParams(json={"type": "string", "pattern": pattern}))
    assert err.param == "structured_outputs.json"


@pytest.mark.parametrize("pattern", ["^((a{100}){100}){3}$", "a{1,1000000}", "[a-z]{1,40}",
                                     "(?P<x>a)(?P=x)", "\\p{L}+", "x" * 200_000])
def test_within_the_budget_is_left_to_the_library(pattern: str) -> None:
    check_regex_budget(pattern, "structured_outputs.regex")  # no refusal here


def test_distinct_hostile_patterns_leave_memory_where_it_was(
        fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    llm = LLM(llm_engine=engine)
    warm = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
        regex="(yes|no)"))
    llm.generate("To be", warm, use_tqdm=False)
    before = resident_bytes()
    outcomes = {"served": 0, "refused": 0}
    for n in range(1, 31):
        params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
            json={"type": "string", "pattern": f"^((a{{100}}){{100}}){{{n}}}$"}))
        try:
            llm.generate("To be", params, use_tqdm=False)
            outcomes["served"] += 1
        except RequestValidationError:
            outcomes["refused"] += 1
    grown_mb = (resident_bytes() - before) / 2**20
    assert outcomes["refused"] >= 25, outcomes  # N >= 6: refused before any compile
    assert grown_mb < 200, grown_mb
    assert_idle(engine)
