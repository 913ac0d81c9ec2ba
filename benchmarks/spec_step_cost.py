"""The seconds of a decode/verify step by its scheduled tokens T, measured by the engine's own
StepCostTable (spec_decode/policy.py) on the Gemma 3 270M file, one thread: the prior PRIOR
in policy.py comes from this run.

Speculation runs with `adaptive` off (every proposal verified) on spec_bench.py's copying
prompts at each concurrency, so the steps cover T from 1 to concurrency * (k + 1); the table
of each run (an exponential average per T on the engine clock) is printed, then the merged
shape relative to T = 1 at the prior's knots, ready to paste into PRIOR.

    .venv/bin/python benchmarks/spec_step_cost.py [--concurrency 1,8,32] [--k 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import gemma_file  # noqa: E402
from spec_bench import COPY_PROMPTS, tokenize  # noqa: E402

CHILD = r'''
import json, sys, torch
cfg = json.loads(sys.stdin.read())
torch.set_num_threads(cfg["threads"])
from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams
c, n = cfg["c"], cfg["len"]
llm = LLM(model=cfg["model"], max_num_seqs=c, max_model_len=n, num_blocks=c * (n // 16 + 2),
          speculative_config={"method": "ngram", "num_speculative_tokens": cfg["k"],
                              "adaptive": False})
prompts = [{"prompt_token_ids": cfg["prompts"][i % len(cfg["prompts"])]} for i in range(c)]
sp = SamplingParams(max_tokens=cfg["out"], temperature=0.0, ignore_eos=True)
llm.generate(prompts, sp, use_tqdm=False)
spec = llm.llm_engine.engine_core.engine_core.scheduler.spec
print(json.dumps({str(t): s for t, s in spec.cost.seconds.items()}))
'''
KNOTS = (1, 4, 8, 16, 32, 64, 128, 256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    model = args.model or gemma_file()
    prompts = tokenize(model, COPY_PROMPTS)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    tables: list[dict[int, float]] = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        cfg = {"model": model, "c": c, "k": args.k, "out": args.output_len,
               "threads": args.threads, "prompts": prompts,
               "len": max(map(len, prompts)) + args.output_len + args.k + 16}
        res = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(cfg), text=True,
                             capture_output=True, env=env)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        table = {int(t): s for t, s in json.loads(res.stdout.strip().splitlines()[-1]).items()}
        tables.append(table)
        print(f"c={c}: " + " ".join(f"{t}:{table[t] * 1e3:.1f}ms" for t in sorted(table)))
    # Merge: each run's table in units of the first run's where their T's overlap.
    merged: dict[int, list[float]] = {}
    for table in tables:
        common = [t for t in table if t in merged]
        scale = (statistics.median(statistics.median(merged[t]) / table[t] for t in common)
                 if common else 1.0)
        for t, s in table.items():
            merged.setdefault(t, []).append(s * scale)
    ts = sorted(merged)
    med = {t: statistics.median(merged[t]) for t in ts}

    def near(t: int) -> float:  # the median of the measured T's around a knot
        close = [med[u] for u in ts if abs(u - t) <= max(1, t // 8)]
        return statistics.median(close) if close else float("nan")

    base = near(KNOTS[0])
    print("PRIOR = (" + ", ".join(f"({t}, {near(t) / base:.2f})" for t in KNOTS) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
