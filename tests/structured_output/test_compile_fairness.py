"""Grammar compiles are shared fairly between clients: one client's queue of large grammars
does not hold up another client's, and a request's compile deadline runs from when the core
admitted it (waiting behind its own client's compiles counts; a compile nobody waits for any
more is cancelled before it starts). Real llguidance compiles on the test tokenizer."""

from __future__ import annotations

import time
from typing import Any

import llguidance
import pytest

from slotserve.structured_output.backend import GuidanceBackend
from slotserve.structured_output.manager import CompilingGrammar, StructuredOutputManager
from tests.helpers import TOKENIZER_EOS

LL = llguidance.LLMatcher
# Each takes a noticeable time to compile (0.3-0.7 s on a 2-core machine) for 104 bytes.
HEAVY = [LL.grammar_from_regex(f"a{{{100_000 + i}}}") for i in range(8)]
# Larger as a text than every heavy one (smallest-first alone would put it last), quick.
LIGHT = LL.grammar_from_regex("(" + "|".join(f"w{i}" for i in range(200)) + ")")


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GuidanceBackend:
    b = GuidanceBackend(lambda: (tokenizer, [TOKENIZER_EOS]), len(tokenizer))
    b.prepare()
    return b


def test_another_clients_grammar_does_not_wait_for_one_clients_queue(
        backend: GuidanceBackend) -> None:
    assert all(len(LIGHT) > len(h) for h in HEAVY)
    manager = StructuredOutputManager(backend, 4, overlap=False, compile_timeout_s=300)
    order: list[str] = []
    try:
        futures = []
        for i, text in enumerate(HEAVY[:4]):
            futures.append(manager.request_grammar(text, "user:heavy"))
            futures[-1].add_done_callback(lambda _, n=f"heavy{i}": order.append(n))
        light = manager.request_grammar(LIGHT, "user:light")
        light.add_done_callback(lambda _: order.append("light"))
        light.result(timeout=120)
        for future in futures:
            future.result(timeout=300)
        # The heavy client's compiles ran one at a time; the light one did not wait for them.
        assert order.index("light") < order.index("heavy1"), order
    finally:
        manager.shutdown()


def test_deadline_runs_from_admission_and_unwanted_compiles_are_cancelled(
        backend: GuidanceBackend) -> None:
    manager = StructuredOutputManager(backend, 4, overlap=False, compile_timeout_s=0.5)
    try:
        grammars = []
        for text in HEAVY:
            sor = manager.make_request(text, "user:heavy")
            assert isinstance(sor.grammar, CompilingGrammar)
            grammars.append(sor.grammar)
        deadline = time.monotonic() + 120
        while not all(g.is_ready() for g in grammars):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        last = grammars[-1]
        # Eight compiles of this size cannot all end within 0.5 s of their admission.
        assert last.error is not None and "not compiled within" in last.error
        assert last.future.cancelled()  # never started: nobody waited for it any more
        time.sleep(1.0)
        assert manager.stats.num_compiled < len(HEAVY)
    finally:
        manager.shutdown()


def test_light_client_compiles_under_load_in_the_core(backend: GuidanceBackend) -> None:
    # The client id the API puts on a core request reaches the manager.
    manager = StructuredOutputManager(backend, 4, overlap=False, compile_timeout_s=300)
    try:
        heavy = [manager.make_request(t, "user:heavy").grammar for t in HEAVY[:4]]
        light = manager.make_request(LIGHT, "user:light").grammar
        assert isinstance(light, CompilingGrammar)
        light.future.result(timeout=120)
        assert light.is_ready() and light.error is None
        assert sum(isinstance(g, CompilingGrammar) and g.future.done() for g in heavy) <= 1
    finally:
        manager.shutdown()
