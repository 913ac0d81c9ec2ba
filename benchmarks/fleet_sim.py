"""A simulated fleet: N replicas, each the real `Scheduler` and KV cache (prefix caching
included) with a step-time model fitted to this machine, behind the same routing policy as
the Ray router (`slotserve.routing.policy`), on a shared-system-prompt trace.

    python benchmarks/fleet_sim.py --fit                  # measure step times, fit, save
    python benchmarks/fleet_sim.py                        # 64 replicas, prefix/pow2/rr
    python benchmarks/fleet_sim.py --replicas 2 --requests 120 --rate 2 --prompts 4 \
        --prompt-len 300 --out-len 16                     # the validation shape (dp_bench.py)

Trace: --prompts system prompts of --prompt-len tokens, each request one of them (uniform)
plus a user part of 20-80 random tokens, --out-len output tokens, Poisson arrivals at
--rate per second. Step time = a + b * prefill tokens + c * decode sequences + d * context
tokens of the decode sequences + e * prefill attention (new tokens x the context they attend
to, the cached prefix included) + f * prefill context (the cached prefix's tokens), fitted
by least squares on the bundled model's real steps (1 torch thread, prefix caching on,
serving-like arrivals: `--fit`). Replicas report their cached hashes to the router every
--report-s seconds (as Ray's routing stats do); the router learns its own decisions at once.
Prints per policy: prefix-cache hit rate, TTFT and TPOT p50 / p99, output tokens per second.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slotserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from slotserve.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from slotserve.core.request import Request  # noqa: E402
from slotserve.core.scheduler import Scheduler  # noqa: E402
from slotserve.routing.policy import ROUTER_POLICIES, RoutingPolicy, request_block_hashes  # noqa: E402
from slotserve.sampling_params import SamplingParams  # noqa: E402

FIT_PATH = Path(__file__).resolve().parent / "results" / "step_time_fit.json"
BLOCK_SIZE = 16
REPORTED = 8192  # hashes a replica reports (slotserve/ray/server.py MAX_REPORTED_HASHES)


Shape = tuple[int, int, int, int, int]


def step_shape(so: SchedulerOutput, sched: Scheduler) -> Shape:
    """(prefill tokens, decode sequences, their context tokens, prefill attention, prefill
    context) of one step. Prefill attention is the sum over prefill chunks of new tokens x
    the context they attend to (cached prefix included) in thousands; prefill context is the
    tokens computed before each prefill chunk (a cached prefix): a 50-token user part behind
    a cached 600-token prompt cost 9.2 ms here where 50 cold tokens cost 5.9, far more than
    its attention pairs explain (the cached KV is read into the chunk's attention whatever
    the chunk's length), which a model in prefill tokens and pairs alone missed."""
    prefill = decode = context = attention = prefill_context = 0
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n >= req.num_tokens and n == 1 and req.num_output_tokens:
            decode += 1
            context += req.num_computed_tokens
        else:
            prefill += n
            attention += n * (req.num_computed_tokens + n) // 1000
            prefill_context += req.num_computed_tokens
    return prefill, decode, context, attention, prefill_context


def step_time(coef: list[float], shape: Shape) -> float:
    """The fitted model; older fits (4 or 5 coefficients) still load."""
    a, b, c, d, e, f = [*coef, 0.0, 0.0][:6]
    p, n_dec, ctx, att, pctx = shape
    return max(a + b * p + c * n_dec + d * ctx + e * att + f * pctx, 1e-4)


# ----- fitting the step-time model on the real engine -------------------------------------------

def fit(seconds: float) -> list[float]:
    """Steps of the real engine on serving-like shapes: prefix caching on, prompts that share
    600-token prefixes mixed with cold ones of 32-900 tokens, arriving one at a time between
    steps (so prefills land in decode batches as they do in a server), not in bursts."""
    import torch

    from slotserve.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.from_engine_args(
        None, model=None, max_model_len=1024, num_blocks=1024, max_num_seqs=32,
        enable_prefix_caching=True, device="cpu", dtype="float32")  # type: ignore[arg-type]
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    sched, runner = core.scheduler, core.model_runner
    rows: list[tuple[int, int, int, int, int, float]] = []
    execute = runner.execute_model

    def timed(so: SchedulerOutput, grammar: Any = None) -> ModelRunnerOutput:
        shape = step_shape(so, sched)
        t0 = time.perf_counter()
        out = execute(so, grammar)
        rows.append((*shape, time.perf_counter() - t0))
        return out

    runner.execute_model = timed
    rng = random.Random(0)
    shared = [[rng.randrange(100, 160) for _ in range(600)] for _ in range(4)]
    deadline = time.monotonic() + seconds
    k = 0
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() or rng.random() < 0.2:
            user = [rng.randrange(100, 160) for _ in range(rng.randint(20, 80))]
            prompt = (rng.choice(shared) + user if rng.random() < 0.5 else
                      [rng.randrange(100, 160) for _ in range(rng.choice((32, 128, 300, 600,
                                                                          900)))])
            engine.add_request(f"fit-{k}", {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=rng.randint(8, 48), temperature=0,
                                              ignore_eos=True))
            k += 1
        engine.step()
    x = np.array([[1.0, *shape] for *shape, _ in rows[5:]])
    y = np.array([t for *_, t in rows[5:]])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    print(f"fitted on {len(y)} steps: a={coef[0] * 1e3:.2f} ms, b={coef[1] * 1e6:.1f} us/prefill "
          f"token, c={coef[2] * 1e6:.1f} us/decode seq, d={coef[3] * 1e9:.1f} ns/context token, "
          f"e={coef[4] * 1e6:.1f} us/1000 prefill attention pairs, f={coef[5] * 1e6:.2f} "
          f"us/prefill context token; median |error| "
          f"{np.median(np.abs(pred - y) / y) * 100:.0f}%")
    return [float(v) for v in coef]


# ----- the simulation ---------------------------------------------------------------------------

@dataclass(slots=True)
class Sim:
    policy: str
    sched: Scheduler
    busy_until: float = 0.0
    stepping: bool = False
    computed: dict[str, int] = field(default_factory=dict)


def fake_execute(so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)


def trace(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(1, 60) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        user = [rng.randrange(1, 60) for _ in range(rng.randint(20, 80))]
        out.append((t, rng.choice(systems) + user))
    return out


def simulate(policy: str, coef: list[float], args: argparse.Namespace) -> dict[str, float]:
    sched_cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                                max_model_len=args.prompt_len + 200)
    cache_cfg = CacheConfig(num_blocks=args.num_blocks, block_size=BLOCK_SIZE)
    fleet = {f"r{i:02d}": Sim(policy, Scheduler(sched_cfg, cache_cfg))
             for i in range(args.replicas)}
    router = RoutingPolicy(policy, seed=args.seed)  # type: ignore[arg-type]
    events: list[tuple[float, int, str, Any]] = []
    seq = 0
    for t, tokens in trace(args):
        heapq.heappush(events, (t, seq, "arrive", tokens))
        seq += 1
    arrival: dict[str, float] = {}
    prompt_len: dict[str, int] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ntok: dict[str, int] = {}
    next_report = 0.0
    busy = 0.0  # the replicas' simulated step seconds, summed (dp_bench compares the real)
    scheduled: dict[str, float] = {}  # when a request was first scheduled (its queue time)
    steps = 0
    params = SamplingParams(max_tokens=args.out_len, temperature=0, ignore_eos=True)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now >= next_report:  # the replicas' periodic routing stats
            for rid, sim in fleet.items():
                pool = sim.sched.kv_cache_manager.block_pool
                router.index.report(rid, list(pool.cached_block_hash_to_block)[-REPORTED:], now)
            next_report = now + args.report_s
        if kind == "arrive":
            hashes = request_block_hashes(payload, BLOCK_SIZE)
            loads = {rid: len(s.sched.running) + len(s.sched.waiting) for rid, s in fleet.items()}
            rid = router.rank(hashes, list(fleet), loads)[0]
            router.routed(rid, hashes, now)
            req_id = f"q{seq}"
            seq += 1
            arrival[req_id] = now
            prompt_len[req_id] = len(payload)
            sim = fleet[rid]
            sim.sched.add_request(Request(req_id, payload, params, arrival_time=now))
            if not sim.stepping:
                sim.stepping = True
                heapq.heappush(events, (max(now, sim.busy_until), seq, "step", rid))
                seq += 1
            continue
        sim = fleet[payload]
        so = sim.sched.schedule(now=now)
        for rid in so.num_scheduled_tokens:
            scheduled.setdefault(rid, now)
        dt = step_time(coef, step_shape(so, sim.sched)) if so.total_num_scheduled_tokens else 0
        outputs = sim.sched.update_from_output(so, fake_execute(so, sim.sched), now + dt)
        busy += dt
        steps += 1 if dt else 0
        for o in outputs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now + dt)
                last[o.request_id] = now + dt
                ntok[o.request_id] = ntok.get(o.request_id, 0) + len(o.new_token_ids)
        sim.busy_until = now + dt
        if sim.sched.has_requests() and so.total_num_scheduled_tokens:
            heapq.heappush(events, (now + dt, seq, "step", payload))
            seq += 1
        else:
            sim.stepping = False
    stats = [s.sched.make_stats() for s in fleet.values()]
    # The serving path (HTTP, the Ray hops, the first SSE event) is no engine step: a constant
    # plus a cost per prompt token (the ids are encoded, parsed, validated, hashed and sent on
    # at every hop), which a request hitting the cache pays in full behind its short step.
    engine_ttft = np.array([first[r] - arrival[r] for r in first])
    per_token = getattr(args, "serving_ms_per_token", 0.0)
    ttft = engine_ttft + np.array([args.serving_overhead_ms + per_token * prompt_len[r]
                                   for r in first]) / 1e3
    tpot = np.array([(last[r] - first[r]) / (ntok[r] - 1) for r in first if ntok[r] > 1])
    span = max(last.values()) - min(arrival.values())
    return {"hit_rate": sum(s.prefix_cache_hits for s in stats)
            / max(1, sum(s.prefix_cache_queries for s in stats)),
            "ttft_p50": float(np.median(ttft)), "engine_ttft_mean": float(engine_ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.median(tpot)), "tpot_p99": float(np.percentile(tpot, 99)),
            "throughput": sum(ntok.values()) / span, "finished": len(first),
            "busy_s": busy, "steps": steps, "engine_ttft_p50": float(np.median(engine_ttft)),
            "queue_mean": float(np.mean([scheduled[r] - arrival[r] for r in first]))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fit", action="store_true", help="measure and fit the step-time model")
    p.add_argument("--fit-seconds", type=float, default=40.0)
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--out-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rate", type=float, default=None,
                   help="arrivals per second (default: 1.5 per replica)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--report-s", type=float, default=1.0)
    p.add_argument("--policies", default=",".join(ROUTER_POLICIES))
    p.add_argument("--serving-overhead-ms", type=float, default=0.0,
                   help="added to every TTFT: the HTTP + Ray path, which the engine-step "
                   "model does not include (measure it: an idle request's TTFT through the "
                   "server minus its prefill step)")
    p.add_argument("--serving-ms-per-token", type=float, default=0.0,
                   help="added to every TTFT per prompt token (dp_bench.py calibrates it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.fit:
        FIT_PATH.parent.mkdir(parents=True, exist_ok=True)
        FIT_PATH.write_text(json.dumps({"coef": fit(args.fit_seconds)}))
    if not FIT_PATH.exists():
        print(f"no step-time model at {FIT_PATH}; run with --fit first", file=sys.stderr)
        return 2
    coef = json.loads(FIT_PATH.read_text())["coef"]
    args.rate = args.rate or 1.5 * args.replicas
    print(f"{args.replicas} replicas, {args.prompts} system prompts x {args.prompt_len} tokens, "
          f"{args.requests} requests at {args.rate:g}/s, {args.out_len} output tokens")
    print(f"{'policy':<12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'tok/s':>8}")
    results = {}
    for policy in args.policies.split(","):
        r = results[policy] = simulate(policy, coef, args)
        print(f"{policy:<12} {r['hit_rate']:>8.3f} {r['ttft_p50'] * 1e3:>7.0f}ms "
              f"{r['ttft_p99'] * 1e3:>7.0f}ms {r['tpot_p50'] * 1e3:>7.1f}ms "
              f"{r['tpot_p99'] * 1e3:>7.1f}ms {r['throughput']:>8.0f}", flush=True)
    if "prefix" in results and "pow2" in results:
        pr, pw = results["prefix"], results["pow2"]
        print(f"prefix vs pow2: TTFT p50 x{pr['ttft_p50'] / pw['ttft_p50']:.2f}, throughput "
              f"x{pr['throughput'] / pw['throughput']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
