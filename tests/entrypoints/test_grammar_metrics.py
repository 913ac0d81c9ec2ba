"""/metrics shows the compiled-grammar cache: its entries and the bytes they are charged (the
cache is bounded by both), and the grammars compiled."""

from __future__ import annotations

import uuid

import httpx

from tests.entrypoints.conftest import MODEL_NAME, Served, scrape


def test_grammar_cache_size_in_metrics(served: Served) -> None:
    before = scrape(served.url)
    tag = uuid.uuid4().hex[:8]
    for i in range(2):  # two grammars no other test compiled
        r = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "To be", "max_tokens": 2,
            "structured_outputs": {"regex": f"(yes|no) {tag}{i}"}})
        assert r.status_code == 200, r.text
    after = scrape(served.url)
    assert after["slotserve:grammars_compiled_total"] - before.get(
        "slotserve:grammars_compiled_total", 0.0) == 2
    assert after["slotserve:grammar_cache_entries"] - before.get(
        "slotserve:grammar_cache_entries", 0.0) == 2
    # Each entry is charged at least its grammar text.
    assert after["slotserve:grammar_cache_bytes"] > before.get(
        "slotserve:grammar_cache_bytes", 0.0)
