"""Speculative decoding (ngram, suffix) against speculation off, on the Gemma 3 270M file,
one thread, in the same run; optionally llama.cpp's server with its own n-gram speculation.

Workloads: (a) copying: a ~200-token function to copy with one change, a passage to repeat,
a list to continue; (b) no copying: the random prompts of vs_llamacpp.py
(bench_serve.make_dataset), greedy; (c) the same random prompts sampled at temperature 0.8
with a seed per request, where the model does not loop, so speculation should turn itself
off at no cost. Each configuration runs `--rounds` times in a child process of its own
(LLM.generate, ignore_eos), alternating the order; the medians are printed with same-run
ratios, the acceptance rate and the tokens per verified step. Every run's tokens are
compared with speculation off (seeded sampling repeats its tokens too).

    .venv/bin/python benchmarks/spec_bench.py [--concurrency 1,8,32] [--rounds 3] [--llamacpp]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from procs import free_port, gemma_file, wait_healthy  # noqa: E402

from slotserve.entrypoints import bench_serve  # noqa: E402

LLAMACPP = Path(os.environ.get("LLAMACPP_DIR", Path.home() / "llamacpp")) / "build/bin/llama-server"

FUNCTION = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    """The total length covered by a list of intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, "
           "counting the one hundred and twelve steps aloud, checking the brass lamp, "
           "wiping the salt from the great lens, and writing the weather in his log before "
           "the ships came round the point.")
COPY_PROMPTS = [
    f"{FUNCTION}\n# The same code with merge_intervals renamed to join_ranges:\n\n",
    f"Repeat the passage exactly.\n\nPassage: {PASSAGE}\n\nRepeated: {PASSAGE}\n\n"
    "Repeat it once more.\n\nRepeated:",
    "Shopping list:\n" + "".join(f"{i}. item number {i} from the store\n" for i in range(1, 13)),
]

CHILD = r'''
import json, sys, time, torch
cfg = json.loads(sys.stdin.read())
torch.set_num_threads(cfg["threads"])
from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams
llm = LLM(model=cfg["model"], max_num_seqs=cfg["c"], max_model_len=cfg["len"],
          num_blocks=cfg["blocks"], speculative_config=cfg["spec"])
sp = [SamplingParams(max_tokens=cfg["out"], temperature=cfg["temperature"], seed=i,
                     ignore_eos=True) for i in range(len(cfg["prompts"]))]
prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
sched = llm.llm_engine.engine_core.engine_core.scheduler
before = sched.make_stats()
t = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t
s = sched.make_stats()
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                  "drafts": s.spec_decode_num_drafts - before.spec_decode_num_drafts,
                  "draft_tokens": s.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                  "accepted": s.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                  "outputs": [o.outputs[0].token_ids for o in outs]}))
'''


def tokenize(model: str, texts: list[str]) -> list[list[int]]:
    code = ("import json, sys; from slotserve.checkpoint.tokenizer import load_tokenizer as f; "
            "t = f(sys.argv[1]); print(json.dumps([t.encode(x) for x in json.loads(sys.stdin.read())]))")
    res = subprocess.run([sys.executable, "-c", code, model], input=json.dumps(texts),
                         text=True, capture_output=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_slotserve(args: argparse.Namespace, c: int, prompts: list[list[int]],
                  spec: dict[str, Any] | None, temperature: float) -> dict[str, Any]:
    per_seq = max(len(p) for p in prompts) + args.output_len + 16
    cfg = {"model": args.model, "c": c, "len": per_seq, "spec": spec, "out": args.output_len,
           "blocks": c * math.ceil(per_seq / 16) + 1, "prompts": prompts,
           "threads": args.threads, "temperature": temperature}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    res = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(cfg), text=True,
                         capture_output=True, env=env)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def run_llamacpp(args: argparse.Namespace, c: int, prompts: list[list[int]],
                 spec_type: str) -> dict[str, Any]:
    port = free_port()
    per_seq = max(len(p) for p in prompts) + args.output_len + 16
    cmd = [str(LLAMACPP), "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(c),
           "-c", str(c * per_seq), "-cb", "--no-webui"]
    if spec_type != "none":
        cmd += ["--spec-type", spec_type]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 300.0, name="llama-server")
        model = bench_serve.served_model(url, None)
        client = argparse.Namespace(max_concurrency=c, seed=0, temperature=0.0, api_key=None)
        reqs = [bench_serve.BenchRequest(p, args.output_len) for p in prompts]
        bench_serve.run_http(url, model, reqs[:1], math.inf, client, "warmup")
        out = bench_serve.run_http(url, model, reqs, math.inf, client, f"llama.cpp {spec_type}")
    finally:
        proc.terminate()
        proc.wait(30)
    return {"tok_s": out["output_throughput"]}


def proposer_cost(n_tokens: int = 2000, k: int = 4) -> None:
    """Microseconds per proposal as a sequence grows token by token (incremental indexing
    included), on random tokens with a repeated passage."""
    import random

    from slotserve.spec_decode.proposers import GlobalSuffixCache, NgramProposer, SuffixProposer

    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(n_tokens // 2)]
    tokens = base + base
    cache = GlobalSuffixCache(100)
    for _ in range(20):
        cache.add([rng.randrange(1000) for _ in range(200)])
    for name, p in (("ngram", NgramProposer(2, 4)), ("suffix", SuffixProposer(cache, 24, 1.0))):
        seq: list[int] = []
        t = time.perf_counter()
        for tok in tokens:  # the request's token list grows in place, as in the engine
            seq.append(tok)
            p.propose(seq, k)
        dt = time.perf_counter() - t
        print(f"{name}: {dt / len(tokens) * 1e6:.1f} us per proposal over {len(tokens)} steps")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the Gemma package's)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--waves", type=int, default=2,
                   help="requests per concurrency slot (c * waves prompts, at least 3)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="random prompts' length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens (the most the "
                   "policy may pick; 7: 8 verified rows, two of the int8 kernels' 4-row tiles)")
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--workloads", default="copying,random,sampled")
    p.add_argument("--llamacpp", action="store_true",
                   help="add llama-server rows (none, ngram-simple, ngram-mod) at c=1 copying")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--proposer-cost", action="store_true",
                   help="only time the proposers (microseconds per proposal)")
    args = p.parse_args()
    if args.proposer_cost:
        proposer_cost()
        return 0
    args.model = args.model or gemma_file()
    copy = tokenize(args.model, COPY_PROMPTS)
    specs: dict[str, dict[str, Any] | None] = {"off": None}
    for m in args.methods.split(","):
        specs[m] = {"method": m, "num_speculative_tokens": args.k}
    load = os.getloadavg()[0]
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        n = max(len(COPY_PROMPTS), c * args.waves)
        vocab = 262144
        rand = [r.prompt_token_ids for r in bench_serve.make_dataset(
            n, args.prompt_len, args.output_len, 0.0, vocab, c)]
        workloads = {"copying": ([copy[i % len(copy)] for i in range(n)], 0.0),
                     "random": (rand, 0.0), "sampled": (rand, 0.8)}
        for wname in args.workloads.split(","):
            prompts, temperature = workloads[wname]
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in specs}
            for r in range(args.rounds):
                names = list(specs) if r % 2 == 0 else list(specs)[::-1]
                for name in names:
                    res = run_slotserve(args, c, prompts, specs[name], temperature)
                    runs[name].append(res)
                    print(f"c={c} {wname} round {r + 1} {name}: {res['tok_s']:.1f} tok/s",
                          flush=True)
            ref = runs["off"][0]["outputs"]
            row: dict[str, Any] = {"c": c, "workload": wname,
                                   "off_tok_s": statistics.median(x["tok_s"] for x in runs["off"])}
            for name in specs:
                if name == "off":
                    continue
                med = statistics.median(x["tok_s"] for x in runs[name])
                d = sum(x["drafts"] for x in runs[name])
                dt = sum(x["draft_tokens"] for x in runs[name])
                acc = sum(x["accepted"] for x in runs[name])
                row[name] = {"tok_s": med, "ratio": med / row["off_tok_s"],
                             "acceptance": acc / dt if dt else 0.0,
                             "tokens_per_verified_step": (acc + d) / d if d else 1.0,
                             "same_tokens": all(x["outputs"] == ref for x in runs[name])}
            rows.append(row)
            if args.llamacpp and c == 1 and wname == "copying":
                for st in ("none", "ngram-simple", "ngram-mod"):
                    row[f"llamacpp_{st}_tok_s"] = statistics.median(
                        run_llamacpp(args, c, prompts, st)["tok_s"] for _ in range(args.rounds))
            print(json.dumps(row), flush=True)  # each row as soon as it is measured
    print(f"\nload average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"{args.threads} thread(s); "
          f"k={args.k}; output {args.output_len} tokens; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'c':>3} {'workload':<8} {'off tok/s':>9} " + " ".join(
        f"{m + ' tok/s':>12} {'x off':>6} {'accept':>6} {'tok/step':>8}" for m in specs if m != "off"))
    for row in rows:
        cells = [f"{row['c']:>3} {row['workload']:<8} {row['off_tok_s']:>9.1f}"]
        for m in specs:
            if m != "off":
                x = row[m]
                cells.append(f"{x['tok_s']:>12.1f} {x['ratio']:>6.2f} {x['acceptance']:>6.2f} "
                             f"{x['tokens_per_verified_step']:>8.2f}"
                             + ("" if x["same_tokens"] else " (OUTPUT DIFFERS)"))
        print(" ".join(cells))
        for k, v in row.items():
            if k.startswith("llamacpp_"):
                print(f"    {k}: {v:.1f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
