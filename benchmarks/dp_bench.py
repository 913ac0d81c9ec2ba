"""Data parallelism on this machine: 2 Ray Serve replicas x 1 thread against one process x 1
and x 2 threads, and the prefix router against pow2 on a shared-prefix workload.

    python benchmarks/dp_bench.py --part throughput --rounds 3  # about 8 minutes (idle cores)
    python benchmarks/dp_bench.py --part prefix --json dp.json   # about 6 minutes
    python benchmarks/dp_bench.py --part ceiling        # about 1 minute on Gemma

Part `throughput`: the same seeded random token-id prompts (--num-prompts, --input-len,
--output-len, ignore_eos) all sent at once (unbounded rate; the servers' admission bounds are
raised so none is refused) to `slotserve serve --threads 1`, `--threads 2` and
`--data-parallel-size 2 --threads 1`; output tokens per second and their ratios, each against
its target (dp2 >= 1.7x threads 1, and above threads 2). Each server's CPU seconds per
process are printed, and per replica the tokens it generated and how long its engine loop was
busy (wall and CPU: a loop busier in wall than in CPU waited for a core). Then (all setups
run) the same requests on two offline engines at once, the bound of this run's 2 replicas
against its one process: no HTTP, no Ray, each engine's own Python in its process.

Part `ceiling`: the same requests on two offline engines started together (half each, one
process and one thread each) against one offline engine with all of them: no HTTP, no Ray,
no front, so what the cores give to two engines at once; the served ratio's gap below it is
what serving the requests costs.

Part `prefix`: the trace of benchmarks/fleet_sim.py (the same function, the same seed: 8
system prompts of 600 tokens, a user part each, Poisson arrivals at 2/s) on
--prefix-num-blocks KV blocks per replica, sent at its arrival times to one process (1
thread) and to 2 replicas under `--router prefix` and `--router pow2`; prefix-cache hit rate
(the servers' own counters, summed over replicas), TTFT median and throughput (targets:
prefix's hit rate >= 0.9x one replica's, TTFT median <= 0.7x pow2's); then the fleet
simulator's prediction for each setup (the same trace, `fleet_sim.simulate`) beside the
measured TTFT p50, throughput and engine-side TTFT mean, with the deviation (the validation
target: within 15%), and the engines' own counters beside the simulator's: steps, busy
seconds (wall and CPU), the engine-side TTFT median (from the histogram) and the serving path
under load (client TTFT mean minus the engine-side mean). Each server is calibrated by idle probes before and after the trace
(`calibrate`: its serving path's latency, constant and per prompt token, and how fast its
steps run now against the fit), which the simulator takes. `--refit` fits the step-time model first; `--setups` runs some setups only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet_sim import FIT_PATH, fit, simulate, step_time, trace  # noqa: E402
from procs import free_port, stop, wait_healthy  # noqa: E402
from server_counters import (  # noqa: E402
    counted,
    cpu_table,
    per_replica,
    process_cpu,
    replica_split,
    server_counters,
)

from slotserve.entrypoints import bench_serve as client  # noqa: E402

MODEL = "dp-bench"
SERVER_PIDS: dict[str, int] = {}  # url -> the server's pid (its tree's CPU time is read)
PROBE_LEN = 640  # the cold calibration probe: about one trace request's prompt
# Admission bounds high enough that the unbounded-rate part is never answered with 429.
ENGINE_FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "32", "--num-blocks", "1024",
                "--max-waiting-seqs", "4096", "--max-waiting-tokens", "100000000",
                "--max-client-share", "1.0"]


@contextmanager
def server(flags: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--port", str(port),
             "--served-model-name", MODEL, "--log-level", "warning", *ENGINE_FLAGS, *flags],
            stdout=out, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        SERVER_PIDS[url] = proc.pid
        try:
            wait_healthy(proc, url, timeout=600, name=" ".join(flags), log=log)
            # The Ray ingress is healthy before its replicas; wait until a request answers.
            warm = [client.BenchRequest([100 + i for i in range(40)], 2)]
            deadline = time.monotonic() + 600
            while not run(url, warm, [0.0])["ok"] and time.monotonic() < deadline:
                time.sleep(2)
            yield url
        finally:
            stop(proc, timeout=90)


def run(url: str, requests: list[client.BenchRequest], at: list[float]) -> dict[str, Any]:
    """Send request i at time at[i] (seconds from start); summarize."""
    ep = client.Endpoint(url, None)

    async def go() -> tuple[list[client.RequestResult], float]:
        start = time.perf_counter()

        async def one(req: client.BenchRequest, t: float) -> client.RequestResult:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
            return await client.send_one(ep, MODEL, req, 0.0)

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, at, strict=True)))
        return list(results), time.perf_counter() - start

    results, duration = asyncio.run(go())
    ok = [r for r in results if r.ok]
    return {"ok": len(ok) == len(results), "failed": len(results) - len(ok),
            "throughput": sum(r.output_tokens for r in ok) / duration,
            "ttft_p50_ms": 1000 * statistics.median([r.ttft for r in ok]) if ok else 0.0,
            "ttft_mean_ms": 1000 * statistics.fmean([r.ttft for r in ok]) if ok else 0.0,
            "errors": [r.error for r in results if not r.ok][:3]}


def part_throughput(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    vocab = client.model_vocab_size(None)
    # Round k's requests (the same in every setup); fresh prompts each round, so no round
    # finds the one before it cached.
    rounds = [client.make_dataset(args.num_prompts, args.input_len, args.output_len, 0.5,
                                  vocab, args.seed + 100 * k) for k in range(args.rounds)]
    setups = {"1 process x 1 thread": ["--threads", "1"],
              "1 process x 2 threads": ["--threads", "2"],
              "2 replicas x 1 thread": ["--data-parallel-size", "2", "--threads", "1"]}
    if args.stream_interval > 1:  # the same, SSE events sent on in batches after the first
        setups[f"2 replicas, interval {args.stream_interval}"] = [
            "--data-parallel-size", "2", "--threads", "1",
            "--stream-interval", str(args.stream_interval)]
    # Warm-up prompts of their own: the timed ones find nothing cached (with the timed
    # requests' first 8, the prefix router kept those on the replica that had them, so one
    # replica took more than its 32 slots and ran a second wave alone).
    warm = client.make_dataset(8, args.input_len, args.output_len, 0.5, vocab, args.seed + 1)
    out = {}
    for name, flags in setups.items():
        if args.setups and name not in args.setups.split(";"):
            continue
        runs = []
        with server(flags, logs / f"{name.replace(' ', '_')}.log") as url:
            run(url, warm, [0.0] * 8)  # warm-up
            for reqs in rounds:
                time.sleep(2.5)  # the replicas' next reports carry what ran before
                split0 = per_replica(url)
                cpu0, me0, t0 = process_cpu(SERVER_PIDS[url]), time.process_time(), time.time()
                r = run(url, reqs, [0.0] * len(reqs))
                wall = time.time() - t0
                cpu1, me1 = process_cpu(SERVER_PIDS[url]), time.process_time()
                time.sleep(2.5)
                runs.append((r, split0, per_replica(url), cpu0, cpu1, wall, me1 - me0))
        # The median round stands for the setup (its CPU and split are printed).
        r, split0, split1, cpu0, cpu1, wall, me = sorted(runs, key=lambda x: x[0]["throughput"]
                                                        )[len(runs) // 2]
        r["rounds"] = [x[0]["throughput"] for x in runs]
        each = "" if len(runs) == 1 else " (median of " + " / ".join(
            f"{t:.1f}" for t in r["rounds"]) + ")"
        print(f"{name:<24} {r['throughput']:8.1f} output tok/s{each}  ({r['failed']} failed; "
              f"load average {os.getloadavg()[0]:.1f}; the load generator {me:.1f} CPU s)",
              flush=True)
        r["cpu_s"] = cpu_table(cpu0, cpu1, wall)
        r["replicas"] = replica_split(split0, split1, wall)
        out[name] = r
    if "1 process x 1 thread" not in out or "1 process x 2 threads" not in out:
        return out
    base = out["1 process x 1 thread"]["throughput"]
    two = out["1 process x 2 threads"]["throughput"]
    if not args.setups:  # the bound of this run: two offline engines at once, no serving
        bounds = [offline_engines(args.model, [reqs[0::2], reqs[1::2]], logs) for reqs in rounds]
        ceiling = out["ceiling"] = statistics.median(bounds)
        print(f"2 offline engines at once {ceiling:8.1f} output tok/s  (x{ceiling / base:.2f}"
              " of 1 process x 1 thread: what 2 replicas would give if serving cost no CPU)",
              flush=True)
    for name in [n for n in out if n.startswith("2 replicas")]:
        dp2 = out[name]["throughput"]
        verdict(f"{name} / 1 process x 1 thread", dp2 / base, ">=", 1.7)
        verdict(f"{name} / 1 process x 2 threads", dp2 / two, ">", 1.0)
    return out


# One offline engine (1 torch thread) in a process of its own: builds, warms up, says it is
# ready, waits for the go file, runs its requests, prints its tokens and wall seconds.
_OFFLINE_ENGINE = """
import json, os, sys, time
import torch
torch.set_num_threads(1)
from slotserve.entrypoints.llm import LLM
from slotserve.sampling_params import SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(spec["model"], max_model_len=1024, max_num_seqs=32, num_blocks=1024)
prompts = [{"prompt_token_ids": ids} for ids, _ in spec["requests"]]
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
          for _, n in spec["requests"]]
llm.generate(prompts[:4], params[:4], use_tqdm=False)
open(spec["ready"], "w").close()
while not os.path.exists(spec["go"]):
    time.sleep(0.005)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "wall": time.perf_counter() - t}))
"""


def offline_engines(model: str | None, groups: list[list[client.BenchRequest]],
                    tmp: Path) -> float:
    """Output tokens per second of len(groups) offline engines started together, one
    process and one thread each, group i's requests all at once in engine i: no HTTP, no
    Ray, no front, so what the cores themselves give."""
    go = tmp / "offline.go"
    go.unlink(missing_ok=True)
    procs, ready = [], []
    for i, group in enumerate(groups):
        ready.append(tmp / f"offline.ready{i}")
        ready[-1].unlink(missing_ok=True)
        spec = {"model": model, "ready": str(ready[-1]), "go": str(go),
                "requests": [[r.prompt_token_ids, r.output_len] for r in group]}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _OFFLINE_ENGINE, json.dumps(spec)], stdout=subprocess.PIPE,
            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    while not all(p.exists() for p in ready):
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError("an offline engine exited before it was ready")
        time.sleep(0.05)
    go.touch()
    results = [json.loads(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]
    return sum(r["tokens"] for r in results) / max(r["wall"] for r in results)


def part_ceiling(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """The throughput part's requests on two offline engines (half each, started together)
    against one offline engine with all of them: what 2 replicas could give on these cores
    if serving them cost nothing. The served ratio's gap below it is the serving path's."""
    vocab = client.model_vocab_size(args.model)
    reqs = client.make_dataset(args.num_prompts, args.input_len, args.output_len, 0.5, vocab,
                               args.seed)
    one = offline_engines(args.model, [reqs], logs)
    two = offline_engines(args.model, [reqs[0::2], reqs[1::2]], logs)
    print(f"offline, 1 engine x 1 thread      {one:8.1f} output tok/s", flush=True)
    print(f"offline, 2 engines x 1 thread     {two:8.1f} output tok/s  (x{two / one:.2f}: the "
          "ceiling of 2 replicas on these cores, serving aside)", flush=True)
    return {"one_engine": one, "two_engines": two, "ratio": two / one}


def verdict(what: str, ratio: float, op: str, target: float) -> bool:
    met = ratio >= target if op == ">=" else ratio > target if op == ">" else ratio <= target
    print(f"  {what:<58} x{ratio:5.2f}   target {op} {target:g}: "
          f"{'met' if met else 'MISSED'}", flush=True)
    return met


def simulated(args: argparse.Namespace, replicas: int, policy: str, coef: list[float],
              overhead_ms: float, per_token_ms: float) -> dict[str, float]:
    """The fleet simulator's prediction for one setup of the prefix part (same trace)."""
    sim_args = SimpleNamespace(
        seed=args.seed, prompts=args.prompts, prompt_len=args.prompt_len,
        requests=args.requests, rate=args.rate, out_len=args.out_len, replicas=replicas,
        num_blocks=args.prefix_num_blocks, max_num_seqs=32, report_s=1.0,
        serving_overhead_ms=overhead_ms, serving_ms_per_token=per_token_ms)
    return simulate(policy, coef, sim_args)  # type: ignore[arg-type]


def calibrate(url: str, coef: list[float]) -> tuple[float, float, float]:
    """(the serving path's latency in ms, its cost per prompt token in ms, the machine's
    speed factor now) from idle probes sent before and after the trace, never from the
    trace. Three kinds: a 16-token request (the serving path plus a small step); cold
    PROBE_LEN-token ones (plus one prefill); and the same prompts again with a new 16-token
    tail, a prefix-cache hit (a small step, but the serving path of a long prompt: its ids
    are encoded, parsed, validated, hashed and sent on at every hop). Cold minus hit is
    prefill work alone, both being as long, so it gives how much slower than at the fit the
    engine runs now (a shared machine's load moves it 2x within minutes; the step model's
    shape, not its scale, is what the fit knows) without the long prompt's serving cost in
    it; hit minus short is that cost (which a hit, the prefix router's median request, pays
    behind its short step). Each hit probe is the last of three tails, so under pow2 both
    replicas hold the prompt by then."""
    rng = random.Random(1)

    def ttft(tokens: list[int]) -> float:
        return float(run(url, [client.BenchRequest(tokens, 1)], [0.0])["ttft_p50_ms"])

    short = statistics.median(ttft([50 + i for i in range(16)]) for _ in range(5))
    cold, hit = [], []
    for _ in range(5):
        prompt = [rng.randrange(200, 260) for _ in range(PROBE_LEN)]
        cold.append(ttft(prompt))
        for _ in range(3):
            last = ttft(prompt + [rng.randrange(200, 260) for _ in range(16)])
        hit.append(last)
    n = PROBE_LEN + 16
    small = step_time(coef, (16, 0, 0, 0, 0))
    hit_step = step_time(coef, (16, 0, 0, 16 * n // 1000, PROBE_LEN))
    cold_step = step_time(coef, (PROBE_LEN, 0, 0, PROBE_LEN * PROBE_LEN // 1000, 0))
    speed = max(0.25, (statistics.median(cold) - statistics.median(hit)) / 1e3
                / max(cold_step - hit_step, 1e-6))
    per_token = max(0.0, (statistics.median(hit) - short - 1e3 * (hit_step - small) * speed)
                    / (n - 16))
    return max(0.0, short - 1e3 * small * speed - 16 * per_token), per_token, speed


def part_prefix(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    sim_args = SimpleNamespace(seed=args.seed, prompts=args.prompts, prompt_len=args.prompt_len,
                               requests=args.requests, rate=args.rate)
    items = trace(sim_args)  # type: ignore[arg-type]
    # Token ids from the middle of the vocabulary, as the simulator's (1..59) are shifted.
    reqs = [client.BenchRequest([t + 100 for t in toks], args.out_len) for _, toks in items]
    at = [t for t, _ in items]
    blocks = ["--num-blocks", str(args.prefix_num_blocks)]  # after ENGINE_FLAGS: it wins
    setups = {"1 process": ["--threads", "1", *blocks],
              "2 replicas, prefix": ["--data-parallel-size", "2", "--router", "prefix", *blocks],
              "2 replicas, pow2": ["--data-parallel-size", "2", "--router", "pow2", *blocks]}
    sim_setups = {"1 process": (1, "prefix"), "2 replicas, prefix": (2, "prefix"),
                  "2 replicas, pow2": (2, "pow2")}
    coef = json.loads(FIT_PATH.read_text())["coef"]
    out = {}
    for name, flags in setups.items():
        if args.setups and name not in args.setups.split(";"):
            continue
        with server(flags, logs / f"{name.replace(' ', '_').replace(',', '')}.log") as url:
            overhead, per_token, speed = calibrate(url, coef)
            time.sleep(2.5)  # the replicas' next routing stats carry their counters
            before = server_counters(url)
            r = run(url, reqs, at)
            time.sleep(2.5)
            r.update(counted(before, server_counters(url)))
            # Probed again after the trace: the mean of the two follows a load that drifts
            # during the run better than either alone.
            after = calibrate(url, coef)
            overhead, per_token, speed = ((overhead + after[0]) / 2, (per_token + after[1]) / 2,
                                          (speed + after[2]) / 2)
            r["serving_path_ms"], r["serving_ms_per_token"], r["speed"] = (
                overhead, per_token, speed)
            r["sim"] = simulated(args, *sim_setups[name], [k * speed for k in coef], overhead,
                                 per_token)
            out[name] = r
        print(f"{name:<20} hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:7.0f} ms  "
              f"(engine-side mean {r['engine_ttft_mean_ms']:.0f} ms; serving path "
              f"{overhead:.0f} ms + {per_token * 1e3:.1f} us/prompt token, steps x{speed:.2f} "
              "the fit's)  "
              f"{r['throughput']:7.1f} tok/s  ({r['failed']} failed)", flush=True)
    if len(out) == len(setups):
        pr, pw, one = out["2 replicas, prefix"], out["2 replicas, pow2"], out["1 process"]
        verdict("prefix hit rate / one replica's", pr["hit_rate"] / max(one["hit_rate"], 1e-9),
                ">=", 0.9)
        verdict("prefix TTFT p50 / pow2's", pr["ttft_p50_ms"] / max(pw["ttft_p50_ms"], 1e-9),
                "<=", 0.7)
    print(f"the fleet simulator on the same trace (step-time model {FIT_PATH.name} scaled by "
          "each server's probes; the serving path added to its TTFT):")
    print(f"  {'setup':<20} {'TTFT p50 measured':>17} {'simulated':>9} {'dev':>6}   "
          f"{'tok/s measured':>14} {'simulated':>9} {'dev':>6}   engine TTFT mean meas./sim.  "
          "hit rate meas./sim.")
    for name, r in out.items():
        sim = r["sim"]
        dt = sim["ttft_p50"] * 1e3 / max(r["ttft_p50_ms"], 1e-9) - 1
        dq = sim["throughput"] / max(r["throughput"], 1e-9) - 1
        ok = "within 15%" if abs(dt) <= 0.15 and abs(dq) <= 0.15 else "OFF by more than 15%"
        print(f"  {name:<20} {r['ttft_p50_ms']:15.0f}ms {sim['ttft_p50'] * 1e3:7.0f}ms "
              f"{dt:+6.0%}   {r['throughput']:14.1f} {sim['throughput']:9.1f} {dq:+6.0%}   "
              f"{r['engine_ttft_mean_ms']:9.0f}/{sim['engine_ttft_mean'] * 1e3:.0f} ms"
              f"{'':>13}{r['hit_rate']:.3f}/{sim['hit_rate']:.3f}  {ok}", flush=True)
    # Where an engine-side gap comes from: the engines' own step counters against the
    # simulator's. Busy wall over busy CPU above 1 means the engine thread waited for a core
    # (other processes ran); busy CPU above the simulated means the steps themselves cost
    # more than the scaled model says.
    print("  the engines during the trace (measured / simulated): steps, busy wall s, busy "
          "CPU s / simulated s, engine-side TTFT p50 (histogram) / simulated, client TTFT "
          "mean - engine-side mean (the serving path under load), the engine-side mean's "
          "split: queued (arrival to first scheduled) / the rest, measured and simulated")
    for name, r in out.items():
        sim = r["sim"]
        print(f"  {name:<20} {r['steps']:6.0f} / {sim['steps']:<6}  {r['busy_s']:6.2f}  "
              f"{r['busy_cpu_s']:6.2f} / {sim['busy_s']:6.2f}   {r['engine_ttft_p50_ms']:5.1f} / "
              f"{sim['engine_ttft_p50'] * 1e3:5.1f} ms   "
              f"{r['ttft_mean_ms'] - r['engine_ttft_mean_ms']:5.1f} ms   queued "
              f"{r['queue_mean_ms']:5.1f} / {sim['queue_mean'] * 1e3:5.1f} ms, rest "
              f"{r['engine_ttft_mean_ms'] - r['queue_mean_ms']:5.1f} / "
              f"{(sim['engine_ttft_mean'] - sim['queue_mean']) * 1e3:5.1f} ms", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("throughput", "prefix", "both", "ceiling"),
                   default="both", help="ceiling: the throughput part's requests on two "
                   "offline engines against one (no HTTP, no Ray): what the cores allow")
    p.add_argument("--engine-flags", default="",
                   help="more `slotserve serve` flags for every server (e.g. --model-impl torch)")
    p.add_argument("--model", default=None,
                   help="model for every server (default: the bundled one). On the bundled model "
                   "the serving path, not the engine, bounds throughput; a real model such as "
                   "the Gemma file shows what a second replica adds to the engine's work")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="throughput: timed rounds per setup "
                   "(fresh prompts each; the median stands)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--prefix-num-blocks", type=int, default=128,
                   help="KV blocks per replica in the prefix part: the 8 x 600-token prompts "
                   "need 304, so one replica (and each of pow2's) holds about a third of "
                   "them and evicts; two replicas hold most if the router keeps each prompt "
                   "on one. (With 160-192, pow2's requests hit about half the time and its "
                   "TTFT median sits on the edge between the hit and the miss mode: it "
                   "jumps between runs.)")
    p.add_argument("--out-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--setups", default="", help="the setups to run (either part), ';' "
                   "between names (default: all three, with the verdicts)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="throughput part: also run 2 replicas with `slotserve serve "
                   "--stream-interval N` (SSE events sent on in batches of N after the first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--refit", action="store_true", help="fit the simulator's step-time "
                   "model first (fleet_sim.py --fit), under the same load as the runs")
    p.add_argument("--fit-seconds", type=float, default=40.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.model:
        ENGINE_FLAGS.extend(["--model", args.model])
    ENGINE_FLAGS.extend(args.engine_flags.split())
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "dp_bench_logs"
    logs.mkdir(exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f}; server logs in {logs}", flush=True)
    results: dict[str, Any] = {}
    if args.refit:  # the simulator's step-time model, measured on this machine now
        FIT_PATH.parent.mkdir(parents=True, exist_ok=True)
        FIT_PATH.write_text(json.dumps({"coef": fit(args.fit_seconds)}))
    if args.part == "ceiling":
        results["ceiling"] = part_ceiling(args, logs)
    if args.part in ("throughput", "both"):
        results["throughput"] = part_throughput(args, logs)
    if args.part in ("prefix", "both"):
        results["prefix"] = part_prefix(args, logs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
