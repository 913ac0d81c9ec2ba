"""Issue 22's memory target: distinct hostile patterns leave the engine within 200 MB of
where it started. Each request carries its own 150-byte JSON schema
`{"type": "string", "pattern": "^((a{100}){100}){N}$"}` (N = 1, 2, ...), the lexer-state
blow-up that once kept about 200 MB per request; each must be refused (a 400-style
RequestValidationError) or served, never kept.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar_memory.py [--num 100]
        [--model PATH | GGUF] [--json out.json]

Offline, in one process (the front's validation and the engine core together, so the
measure is stricter than the core's alone), on the real Gemma 3 270M GGUF by default (its
262k vocabulary is what makes lexer states costly). Reported: the resident memory after a
warm-up request with a small grammar (the grammar library's tokenizer built), after every
10th request and at the end; the compiled-grammar cache then (entries, bytes charged) and
the memory once it is emptied (what of the growth the cache held); how each request ended; the time each refusal took (median,
max).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from procs import gemma_file  # noqa: E402

from slotserve.entrypoints.llm import LLM  # noqa: E402
from slotserve.errors import RequestValidationError  # noqa: E402
from slotserve.memory import resident_bytes  # noqa: E402
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

TARGET_MB = 200


def pattern_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "string", "pattern": f"^((a{{100}}){{100}}){{{n}}}$"}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the Gemma 3 270M GGUF")
    p.add_argument("--num", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM(model=args.model or gemma_file(), max_num_seqs=4, max_model_len=512)
    warm = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="(yes|no)"))
    llm.generate("Answer:", warm, use_tqdm=False)
    start_mb = resident_bytes() / 2**20
    outcomes: Counter[str] = Counter()
    refusal_s: list[float] = []
    samples = []
    for n in range(1, args.num + 1):
        t = time.perf_counter()
        try:
            out = llm.generate("Say a:", pattern_params(n), use_tqdm=False)
            outcomes[f"served ({out[0].outputs[0].finish_reason})"] += 1
        except RequestValidationError as exc:
            refusal_s.append(time.perf_counter() - t)
            outcomes["refused: " + re.sub(r"\d+", "N", str(exc))[:90]] += 1
        if n % 10 == 0 or n == args.num:
            mb = resident_bytes() / 2**20
            samples.append((n, mb))
            print(f"after {n:4d} requests: {mb:7.0f} MB (+{mb - start_mb:.0f})", flush=True)
    end_mb = resident_bytes() / 2**20
    # What the growth is: the compiled grammars of the patterns that were served, cached
    # (and their lexer states, built lazily as their masks are computed, which the cache's
    # byte charge does not see). Emptying the cache shows how much of the growth it held.
    stats = llm.get_stats()
    cache = {"entries": stats.grammar_cache_entries,
             "charged_mb": stats.grammar_cache_bytes / 2**20}
    llm.llm_engine.engine_core.call_utility("clear_grammar_cache").result(60)
    cleared_mb = resident_bytes() / 2**20
    print(f"grammar cache at the end: {cache['entries']} entries charged "
          f"{cache['charged_mb']:.0f} MB; after emptying it: {cleared_mb:.0f} MB "
          f"(+{cleared_mb - start_mb:.0f})", flush=True)
    report = {"start_mb": start_mb, "end_mb": end_mb, "growth_mb": end_mb - start_mb,
              "grammar_cache": cache, "after_cache_cleared_mb": cleared_mb,
              "peak_sample_mb": max(mb for _, mb in samples), "outcomes": dict(outcomes),
              "refusal_s_median": statistics.median(refusal_s) if refusal_s else None,
              "refusal_s_max": max(refusal_s, default=None), "target_growth_mb": TARGET_MB}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["growth_mb"] <= TARGET_MB else 1


if __name__ == "__main__":
    raise SystemExit(main())
