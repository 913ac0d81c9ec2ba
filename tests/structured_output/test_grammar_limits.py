"""Grammars are untrusted: the ones llguidance gives up on within their first token are
refused at compile (a 400 for their client, never a failed step), with a bounded excerpt of
the library's message and no state dump; failed grammars stay out of the compiled cache, the
cache is bounded in bytes, and failures are logged rate-limited."""

from __future__ import annotations

import logging
from typing import Any

import llguidance
import pytest

from slotserve.entrypoints.llm import LLM
from slotserve.errors import RequestValidationError
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from slotserve.structured_output.backend import GrammarCompileError, GuidanceBackend
from slotserve.structured_output.budget import MAX_OPTIONAL_PROPERTIES
from slotserve.structured_output.grammar import checked_grammar
from slotserve.structured_output.limits import MAX_ERROR_CHARS, RateLimitedLog, error_excerpt
from slotserve.structured_output.manager import StructuredOutputManager
from tests.engine.test_engine_fake import assert_idle
from tests.helpers import TOKENIZER_EOS, FakeEngineFactory

LL = llguidance.LLMatcher
# Each passes the library's validation and builds a matcher, then fails at the first token.
FIRST_TOKEN_FAILURES = {
    "lark counted": LL.grammar_from_lark('start: "a"~100000'),
    "empty language": LL.grammar_from_lark('start: "a" start'),
    "regex a{1000000}": LL.grammar_from_regex("a{1000000}"),
}


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GuidanceBackend:
    b = GuidanceBackend(lambda: (tokenizer, [TOKENIZER_EOS]), len(tokenizer))
    b.prepare()
    return b


@pytest.mark.parametrize("name", list(FIRST_TOKEN_FAILURES))
def test_first_token_failure_refused_at_compile(backend: GuidanceBackend, name: str) -> None:
    grammar = FIRST_TOKEN_FAILURES[name]
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(grammar)
    message = str(info.value)
    assert len(message) <= MAX_ERROR_CHARS
    assert "non-verbose" not in message and "\n" not in message
    assert grammar[:60] not in message  # never our generated grammar


def test_optional_properties_budget_is_below_what_the_library_refuses(
        backend: GuidanceBackend) -> None:
    # The front's budget (structured_output.budget) refuses more optional properties than
    # MAX_OPTIONAL_PROPERTIES because the engine's compile would fail them at the first token
    # (the parser's row of alternatives past max_items_in_row): 499 do, the budget's do not.
    def optional(num: int) -> str:
        return LL.grammar_from_json_schema(
            {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(num)}},
            defaults={"whitespace_flexible": False})

    backend.compile(optional(MAX_OPTIONAL_PROPERTIES))
    with pytest.raises(GrammarCompileError, match="row has"):
        backend.compile(optional(499))


def test_a_compiled_grammar_starts_clean(backend: GuidanceBackend) -> None:
    # The first-step check consumed a token and must have undone it.
    matcher = backend.compile(LL.grammar_from_regex("(ab|cd)x"))
    assert matcher.consume_tokens(backend.ll_tokenizer.tokenize_str("cdx"))
    assert matcher.is_accepting()


def test_engine_refuses_first_token_failure_as_invalid(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    llm = LLM(llm_engine=engine)
    for spec in (StructuredOutputsParams(grammar='start: "a"~100000'),
                 StructuredOutputsParams(grammar='start: "a" start'),
                 StructuredOutputsParams(regex="a{1000000}")):
        with pytest.raises(RequestValidationError) as info:
            llm.generate("To be", SamplingParams(max_tokens=4, structured_outputs=spec),
                         use_tqdm=False)
        # (The regex is refused before the core, by the validation budget.)
        assert (info.value.param or "").startswith("structured_outputs")
        assert len(str(info.value)) < MAX_ERROR_CHARS + 100
    out = llm.generate("To be", SamplingParams(max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert_idle(engine)


def _manager(backend: GuidanceBackend, **kwargs: Any) -> StructuredOutputManager:
    return StructuredOutputManager(backend, 4, overlap=False, **kwargs)


def test_failed_grammars_stay_out_of_the_cache(backend: GuidanceBackend) -> None:
    manager = _manager(backend)
    try:
        bad = FIRST_TOKEN_FAILURES["empty language"]
        with pytest.raises(GrammarCompileError) as first:
            manager.request_grammar(bad).result(timeout=120)
        assert manager.stats.num_failed == 1 and manager.stats.cached_bytes == 0
        # Resent: refused the same way at once, without another compile.
        again = manager.request_grammar(bad)
        assert again.done()
        with pytest.raises(GrammarCompileError) as second:
            again.result()
        assert str(second.value) == str(first.value)
        assert manager.stats.num_compiled == 1
    finally:
        manager.shutdown()


def test_cache_is_bounded_in_bytes(backend: GuidanceBackend) -> None:
    texts = [LL.grammar_from_regex(f"x{{{100 + i}}}[a-z]{{{4000 + i}}}")
             for i in range(6)]
    one = len(texts[0])
    manager = _manager(backend, max_cached_bytes=3 * one + one // 2)
    try:
        for text in texts:
            manager.request_grammar(text).result(timeout=120)
            assert (manager.stats.cached_bytes <= manager.max_cached_bytes
                    or len(manager._cache) == 1)
        # Each entry costs at least its text: at most three fit, the newest is kept.
        assert 1 <= len(manager._cache) <= 3
        assert texts[-1] in manager._cache and texts[0] not in manager._cache
    finally:
        manager.shutdown()


def test_cache_counted_and_emptied(backend: GuidanceBackend) -> None:
    # The counts /metrics shows (grammar_cache_entries / _bytes), and clear_cache, which
    # benchmarks/grammar_memory.py uses to show what of the engine's growth the cache held.
    manager = _manager(backend)
    try:
        for i in range(2):
            manager.request_grammar(LL.grammar_from_regex(f"(yes|no){i}")).result(timeout=120)
        assert manager.stats.cached_entries == 2 and manager.stats.cached_bytes > 0
        manager.clear_cache()
        assert manager.stats.cached_entries == 0 and manager.stats.cached_bytes == 0
        assert not manager._cache
    finally:
        manager.shutdown()


def test_validation_uses_the_same_limits() -> None:
    # The front refuses what the core's limits refuse without a tokenizer (grammar size).
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(120_000))
    with pytest.raises(RequestValidationError) as info:
        checked_grammar(StructuredOutputsParams(grammar=huge))
    assert info.value.param == "structured_outputs.grammar"
    assert len(str(info.value)) < MAX_ERROR_CHARS + 100


def test_error_excerpt_drops_dumps_and_bounds_length() -> None:
    panic = ("parser error: boom\n<state>\nrow 1 ... \nGrammar:\nstart: x\nstack backtrace:\n"
             "   0: rust_begin_unwind")
    assert error_excerpt(panic) == "parser error: boom"
    long = error_excerpt("x" * 10_000)
    assert len(long) <= MAX_ERROR_CHARS and long.endswith("(truncated)")


def test_failure_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("slotserve.test_limits"), burst=3, period_s=60)
    with caplog.at_level(logging.WARNING, "slotserve.test_limits"):
        logged = sum(log.warning("grammar refused: %s", i) for i in range(100))
    assert logged == 3 and len(caplog.records) == 3


def test_small_grammar_compiles_before_waiting_large_ones(backend: GuidanceBackend) -> None:
    manager = _manager(backend)
    order: list[str] = []
    try:
        texts = {"first": LL.grammar_from_regex("a{100000}"),
                 "large1": LL.grammar_from_regex("b{20000}[a-z]{3000}"),
                 "large2": LL.grammar_from_regex("c{20000}[a-z]{3000}"),
                 "small": LL.grammar_from_regex("(yes|no)")}
        futures = []
        for name, text in texts.items():  # submitted in this order, while "first" compiles
            future = manager.request_grammar(text)
            future.add_done_callback(lambda _, n=name: order.append(n))
            futures.append(future)
        for future in futures:
            future.result(timeout=300)
        # In arrival order the small one would come last.
        assert order.index("small") < order.index("large1")
        assert order.index("small") < order.index("large2")
    finally:
        manager.shutdown()
