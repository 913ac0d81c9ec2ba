"""Structured outputs: offline throughput with every request under a JSON schema vs none, in
the same run, and the bitmask's cost per token.

The workload is offline_throughput.py's: 64 requests, prompts of uniform 32-256 random token
ids, outputs of uniform 32-256 tokens, greedy, ignore_eos, max_num_seqs 32 (concurrency 32).
The constrained run puts every request under one JSON schema (a transcript: an array of
speaker / line objects) whose minItems it cannot reach within 256 tokens, so both runs
produce exactly the same number of tokens per request and batch the same way; the ratio is
constrained tok/s over free tok/s. The schema is compiled once, in a warm-up, as a server
would have it cached.

Two constrained engines run: one filling the bitmask on a helper thread while the forward
pass runs (the default, `grammar_bitmask_overlap=True`), one filling it on the step loop
before the forward pass. Rounds alternate free / overlapped / inline (rotating the order);
reported are medians, ratios being medians of each round's pairs (wall time, and this
process's CPU time, which the load of other processes on a shared machine inflates far
less; with overlap it includes the helper thread), and from the engines' counters the
bitmask fill time per constrained token and the part of it the step loop waited for.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured_bench.py [--rounds 3]
        [--model PATH | GGUF] [--num-requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import Workload, make_workload  # noqa: E402

from slotserve.engine.args import DEFAULT_MODEL  # noqa: E402
from slotserve.engine.loading import load_model_config  # noqa: E402
from slotserve.entrypoints.llm import LLM  # noqa: E402
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["title", "lines"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "lines": {"type": "array", "minItems": 100, "items": {
            "type": "object", "additionalProperties": False, "required": ["speaker", "text"],
            "properties": {"speaker": {"enum": ["HAMLET", "OPHELIA", "HORATIO", "GHOST"]},
                           "act": {"type": "integer", "minimum": 1, "maximum": 5},
                           "text": {"type": "string", "maxLength": 60}}}}}}


@dataclass(slots=True)
class Run:
    wall_s: float
    cpu_s: float  # time.process_time: this process's CPU time, every thread
    tokens: int
    mask_rows: int = 0
    mask_fill_s: float = 0.0
    mask_wait_s: float = 0.0


class Engine:
    def __init__(self, path: str, work: Workload, max_num_seqs: int, constrained: bool,
                 overlap: bool = True) -> None:
        self.llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
                       max_model_len=work.max_len + 1, grammar_bitmask_overlap=overlap)
        spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                      structured_outputs=spec) for n in work.output_lens]
        self.inputs = [{"prompt_token_ids": p} for p in work.prompts]
        self.expected = sum(work.output_lens)
        # Warm up (and compile the schema once, as a server would have it cached).
        self.llm.generate(self.inputs[:2], self.params[:2], use_tqdm=False)

    def run(self) -> Run:
        before = self.llm.get_stats()
        wall, cpu = time.perf_counter(), time.process_time()
        outs = self.llm.generate(self.inputs, self.params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = self.llm.get_stats()
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == self.expected, "a request ended early: the schema completed?"
        return Run(wall, cpu, produced,
                   after.num_grammar_mask_rows - before.num_grammar_mask_rows,
                   after.grammar_mask_fill_s - before.grammar_mask_fill_s,
                   after.grammar_mask_wait_s - before.grammar_mask_wait_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a Hugging Face folder or a GGUF file (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = load_model_config(args.model).vocab_size
    work = make_workload(args.num_requests, vocab, (32, 256), (32, 256), args.seed)
    print(f"{args.model}: {len(work.prompts)} requests, {sum(work.output_lens)} output tokens, "
          f"max_num_seqs {args.max_num_seqs}, {args.threads} torch thread(s), "
          f"{args.rounds} rounds", flush=True)
    engines = {"free": Engine(args.model, work, args.max_num_seqs, constrained=False),
               "overlapped": Engine(args.model, work, args.max_num_seqs, constrained=True),
               "inline": Engine(args.model, work, args.max_num_seqs, constrained=True,
                                overlap=False)}
    names = list(engines)
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            run = engines[name].run()
            runs[name].append(run)
            per_token = (f"  mask fill {1e6 * run.mask_fill_s / run.mask_rows:.1f} us/token, "
                         f"step loop waited {1e6 * run.mask_wait_s / run.mask_rows:.1f} us/token"
                         if run.mask_rows else "")
            print(f"round {r + 1} {name:10s}: {run.wall_s:6.2f} s  "
                  f"{run.tokens / run.wall_s:8.1f} tok/s | {run.cpu_s:6.2f} s CPU "
                  f"{run.tokens / run.cpu_s:8.1f} tok/s{per_token}", flush=True)
    med = statistics.median
    tok_s = {n: [r.tokens / r.wall_s for r in runs[n]] for n in names}
    cpu_tok_s = {n: [r.tokens / r.cpu_s for r in runs[n]] for n in names}
    report: dict[str, Any] = {"model": args.model, "num_requests": args.num_requests,
                              "max_num_seqs": args.max_num_seqs, "rounds": args.rounds,
                              "threads": args.threads, "output_tokens": runs["free"][0].tokens,
                              "tok_s": {n: med(v) for n, v in tok_s.items()},
                              "tok_s_rounds": tok_s,
                              "cpu_tok_s": {n: med(v) for n, v in cpu_tok_s.items()},
                              "cpu_tok_s_rounds": cpu_tok_s}
    for name in ("overlapped", "inline"):
        ratio = med(c / f for c, f in zip(tok_s[name], tok_s["free"], strict=True))
        cpu_ratio = med(c / f for c, f in zip(cpu_tok_s[name], cpu_tok_s["free"], strict=True))
        rows = sum(r.mask_rows for r in runs[name])
        fill = 1e6 * sum(r.mask_fill_s for r in runs[name]) / rows
        wait = 1e6 * sum(r.mask_wait_s for r in runs[name]) / rows
        report[name] = {"ratio_vs_free": ratio, "cpu_ratio_vs_free": cpu_ratio,
                        "mask_fill_us_per_token": fill,
                        "mask_wait_us_per_token": wait,
                        "runs": [asdict(r) for r in runs[name]]}
        print(f"{name:10s}: {med(tok_s[name]):8.1f} tok/s vs free {med(tok_s['free']):8.1f}: "
              f"ratio {ratio:.3f} wall, {cpu_ratio:.3f} CPU time; bitmask {fill:.1f} us per "
              f"token to fill, {wait:.1f} us per token waited for by the step loop",
              flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
