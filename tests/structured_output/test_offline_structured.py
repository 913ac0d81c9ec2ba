"""Structured outputs offline on a random-weight model (which writes noise unconstrained),
with the checker on: every output that finishes with "stop" parses and validates against
its schema (over 220 generated schemas) or matches its regex, choice or grammar, in every
sampling mode; and the bitmask holds in the sampler for each mode."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import bounded
from tests.structured_output.schemas import random_schemas

MODES: list[dict[str, Any]] = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.9, top_k=20),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    dict(temperature=1.0, n=2, seed=1),
    dict(temperature=1.0, logprobs=3),
]


@pytest.fixture(scope="module")
def llm(tiny_llama: SimpleNamespace) -> LLM:
    return LLM(model=tiny_llama.path, check=True, dtype="float32", device="cpu",
               max_num_seqs=64, num_blocks=2048, block_size=8, seed=0)


def test_generated_schemas_validate_in_every_sampling_mode(llm: LLM) -> None:
    schemas = random_schemas(220, seed=0)
    params = [SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=s),
                             **MODES[i % len(MODES)]) for i, s in enumerate(schemas)]
    outs = llm.generate(["To be, or not"] * len(schemas), params, use_tqdm=False)
    finish: Counter[str | None] = Counter()
    for out, schema, p in zip(outs, schemas, params, strict=True):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            finish[c.finish_reason] += 1
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
            else:  # cut by max_tokens (a number's decimals can go on)
                assert c.finish_reason == "length" and len(c.token_ids) == 120
            if p.logprobs is not None:
                # Only allowed tokens are reported; the chosen one is always among them.
                assert all(tok in entry and len(entry) <= 4
                           for tok, entry in zip(c.token_ids, c.logprobs or [], strict=True))
    total = sum(finish.values())
    assert finish["stop"] >= 0.9 * total, finish  # bounded schemas finish even from noise
    stats = llm.get_stats()
    assert stats.num_grammar_mask_rows == stats.generation_tokens_total > 0
    assert stats.num_waiting_for_grammar == 0


def test_unconstrained_output_is_noise(llm: LLM) -> None:
    out = llm.generate("To be, or not", SamplingParams(max_tokens=40, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


REGEXES = [r"[A-Z][a-z]{1,6}( [a-z]{1,5}){0,3}\.", r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?",
           r"[a-f0-9]{8}", r"(ab|cd)+e"]
CHOICES = [["yes", "no"], ["Paris", "London", "Tokyo", "日本"], ["a b c", "a", "b"]]
LARK = 'start: "[" item ("," item)* "]"\nitem: NUM | WORD\nNUM: /-?[0-9]{1,3}/\nWORD: /[a-z]{1,4}/'


def test_regex_choice_and_grammar_match(llm: LLM) -> None:
    specs = ([StructuredOutputsParams(regex=r) for r in REGEXES]
             + [StructuredOutputsParams(choice=c) for c in CHOICES]
             + [StructuredOutputsParams(grammar=LARK)])
    params = [SamplingParams(max_tokens=40, n=3, seed=i, temperature=1.0, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = llm.generate(["Now is the winter"] * len(specs), params, use_tqdm=False)
    stops = 0
    for out, spec in zip(outs, specs, strict=True):
        for c in out.outputs:
            if c.finish_reason != "stop":
                continue
            stops += 1
            if spec.regex is not None:
                assert re.fullmatch(spec.regex, c.text), (spec.regex, c.text)
            elif spec.choice is not None:
                assert c.text in spec.choice
            else:
                assert re.fullmatch(r"\[(-?\d{1,3}|[a-z]{1,4})(,(-?\d{1,3}|[a-z]{1,4}))*\]",
                                    c.text), c.text
    assert stops >= 0.7 * 3 * len(specs)


def test_ignore_eos_still_stops_when_the_grammar_is_complete(llm: LLM) -> None:
    out = llm.generate("To be", SamplingParams(
        max_tokens=30, ignore_eos=True, structured_outputs=StructuredOutputsParams(
            choice=["forsooth"])), use_tqdm=False)[0].outputs[0]
    assert out.text == "forsooth" and out.finish_reason == "stop"


def test_the_sampler_keeps_the_bitmask_in_every_mode() -> None:
    import numpy as np
    import torch

    from slotserve.worker.sampler import (
        Sampler,
        SamplingMetadata,
        grammar_bias,
        unpack_grammar_bias,
    )

    vocab, rows = 300, 8
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 5
    allowed = torch.rand(rows, vocab, generator=gen) < 0.05
    allowed[:, 7] = True
    bits = np.zeros((rows, (vocab + 31) // 32 * 32), dtype=np.uint8)
    bits[:, :vocab] = allowed.numpy()
    bias = grammar_bias(np.packbits(bits, axis=1, bitorder="little").view(np.int32), vocab,
                        torch.device("cpu"))
    assert torch.equal(bias == 0, allowed)
    # The accelerators' way (tensor operations) gives the same rows.
    packed = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32))
    assert torch.equal(unpack_grammar_bias(packed, vocab), bias)
    # Every row under the grammar in order, or the same rows listed backwards.
    layouts = [(None, bias), (torch.arange(rows - 1, -1, -1), bias.flip(0))]
    ids = torch.randint(0, vocab, (rows, 12), generator=gen)
    sampler = Sampler("cpu", seed=0)
    variants: list[dict[str, Any]] = [
        {}, {"top_k": torch.full((rows,), 5)}, {"top_p": torch.full((rows,), 0.5)},
        {"min_p": torch.full((rows,), 0.2)}, {"row_seeds": {0: 11, 3: 12}},
        {"repetition_penalty": torch.full((rows,), 1.5), "prompt_output_ids": ids},
        {"frequency_penalty": torch.full((rows,), -2.0), "presence_penalty": torch.full(
            (rows,), -2.0), "output_ids": ids},
        {"max_num_logprobs": 5}]
    for greedy, extra, (grammar_rows, row_bias) in itertools.product(
            (True, False), variants, layouts):
        temp = torch.zeros(rows) if greedy else torch.full((rows,), 1.5)
        meta = SamplingMetadata(temperature=temp, all_greedy=greedy, grammar_rows=grammar_rows,
                                grammar_bias=row_bias, **extra)
        for _ in range(5):
            out = sampler(logits.clone(), meta)  # the sampler masks its logits in place
            assert allowed[torch.arange(rows), out.sampled].all(), (greedy, extra)
            if out.topk_ids is not None and out.topk_logprobs is not None:
                finite = out.topk_logprobs > float("-inf")
                assert allowed.gather(1, out.topk_ids)[finite].all()


def test_a_failure_isolated_one_by_one_keeps_each_grammar(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails in the worker reruns its requests one at a time (issue 11); each
    rerun gets only its own request's bitmask row, and the constrained ones come out as in
    a clean run."""
    schema = random_schemas(1, seed=5)[0]
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["To be", "or not", "to be:", "that is"]
    engine = llm.llm_engine

    def run() -> dict[str, Any]:
        for i, p in enumerate(prompts):
            engine.add_request(f"iso-{i}", p, params)
        done = {}
        for _ in bounded(engine.has_unfinished_requests):
            done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        return done

    clean = run()
    runner = engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
    real = runner._execute

    def execute(so: Any, ids: list[str], grammar_output: Any = None) -> Any:
        if "iso-1" in ids:
            raise RuntimeError("injected fault tied to one request")
        return real(so, ids, grammar_output)

    monkeypatch.setattr(runner, "_execute", execute)
    faulty = run()
    assert faulty["iso-1"].finish_reason == "error"
    for rid in ("iso-0", "iso-2", "iso-3"):
        assert faulty[rid].token_ids == clean[rid].token_ids
        if faulty[rid].finish_reason == "stop":
            jsonschema.validate(json.loads(faulty[rid].text), schema)
