"""Grammar-constrained requests speculate: drafts are cut at the first token the request's
grammar refuses, each verified position is masked as if the drafts before it were kept, and
the matcher advances by exactly the kept tokens (the checker's check_grammars, on here).
Greedy JSON-schema output with speculation equals it without, token for token."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import jsonschema

from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import random_schemas

# Arrays of one enum string and of small integers: constrained noise that repeats itself, so
# prompt lookup finds drafts inside the JSON.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"tags": {"type": "array", "minItems": 6, "maxItems": 12,
                                               "items": {"enum": ["alpha beta", "gamma"]}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "array", "minItems": 8, "maxItems": 16,
     "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                        "maximum": 9}},
               "required": ["id"], "additionalProperties": False}},
    *random_schemas(10, seed=3),
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}


def _run(path: str, spec: dict[str, Any] | None) -> tuple[list[Any], Any]:
    llm = LLM(model=path, check=True, dtype="float32", device="cpu", max_num_seqs=8,
              num_blocks=1024, block_size=8, seed=0, speculative_config=spec)
    params = [SamplingParams(max_tokens=96, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=s))
              for s in SCHEMAS]
    outs = llm.generate(["To be, or not"] * len(SCHEMAS), params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_core.scheduler.make_stats()
    return [o.outputs[0] for o in outs], stats


def test_json_schema_greedy_with_speculation_equals_without(tiny_llama: SimpleNamespace
                                                            ) -> None:
    off, _ = _run(tiny_llama.path, None)
    on, stats = _run(tiny_llama.path, SPEC)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    for c, schema in zip(on, SCHEMAS, strict=True):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
    assert sum(c.finish_reason == "stop" for c in on) >= len(SCHEMAS) // 2
