"""The chaos benchmark's grammar class on its own (`chaos_hostile.py --only grammars`) against
the real server: only those patterns run, and every one is served or refused with a 400 that
names the field the client sent, never a 500."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.entrypoints.conftest import Served

HOSTILE = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_hostile.py"
FIELDS = ("structured_outputs", "response_format", "tools")


def test_only_the_grammar_class_runs_and_refusals_name_the_field(served: Served) -> None:
    out = subprocess.run([sys.executable, str(HOSTILE), served.url, "--seconds", "3",
                          "--only", "grammars"], capture_output=True, timeout=120, check=True)
    counts: dict[str, dict[str, int]] = json.loads(out.stdout)
    assert set(counts) <= {"grammar_memory_distinct", "grammar_first_token_failure",
                           "grammar_0.9MB_schema", "grammar_ambiguous_wide", "tool_with_ref"}
    assert {"grammar_memory_distinct", "grammar_first_token_failure"} <= set(counts), counts
    for pattern, outcomes in counts.items():
        for outcome in outcomes:
            status, _, field = outcome.partition(" ")
            assert status in ("200", "400"), (pattern, outcomes)
            if status == "400":
                assert field.startswith(FIELDS), (pattern, outcomes)
    # Grammars the library gives up on at the first token are refused at compile, for the
    # field that was sent (the count a bare status would not show).
    assert all(o.startswith("400 structured_outputs")
               for o in counts["grammar_first_token_failure"]), counts
