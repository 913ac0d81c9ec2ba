"""Model-free scheduler benchmark: schedule -> fake sampled tokens -> update_from_output.

The workload and the fake model match `../shared/anchors/vllm-scheduler/vllm_sched_bench.py`
so that the same flags run vLLM's scheduler on the same requests; `--vllm-env FILE` runs that
harness in the same invocation (interleaved with ours, run by run) and prints the ratio.

A partial-prefill chunk samples nothing; every other scheduled request gets one token;
requests use ignore_eos and max_tokens = their output length. Only scheduler time is timed
(schedule + update_from_output; the slot ledger is always on). The checker's overhead is
measured on the same workload as a ratio of scheduler+checker time to scheduler time.

Example (KV never limiting):
  python benchmarks/scheduler_bench.py --num-requests 2000 --min-prompt 64 --max-prompt 512 \
      --min-output 32 --max-output 256 --max-num-seqs 256 --max-num-batched-tokens 8192 \
      --block-size 16 --num-blocks 16384 --seed 0 --repeat 3 \
      --vllm-env /root/anchor-work/vllm-sched-env.sh
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slotserve.check import InvariantChecker  # noqa: E402
from slotserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from slotserve.core.outputs import ModelRunnerOutput  # noqa: E402
from slotserve.core.request import Request  # noqa: E402
from slotserve.core.scheduler import Scheduler  # noqa: E402
from slotserve.sampling_params import SamplingParams  # noqa: E402

VLLM_HARNESS = Path(__file__).resolve().parents[2] / "shared/anchors/vllm-scheduler/vllm_sched_bench.py"
FORWARDED = ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output",
             "max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "seed",
             "max_model_len", "vocab_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=50272)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-prefix-len", type=int, default=0)
    ap.add_argument("--num-prefixes", type=int, default=1)
    ap.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each engine; medians reported")
    ap.add_argument("--no-checker-run", action="store_true", help="skip the checker-on run")
    ap.add_argument("--vllm-env", default=None,
                    help="env file from setup_vllm_sched.sh: also run vLLM's scheduler")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap.parse_args(argv)


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, priority) per request; the same draws as the vLLM harness."""
    rng = random.Random(args.seed)
    lo, hi = 10, args.vocab_size - 1
    prefixes = [[rng.randint(lo, hi) for _ in range(args.shared_prefix_len)]
                for _ in range(max(1, args.num_prefixes))]
    work = []
    for i in range(args.num_requests):
        plen = rng.randint(args.min_prompt, args.max_prompt)
        olen = rng.randint(args.min_output, args.max_output)
        prompt = [rng.randint(lo, hi) for _ in range(plen)]
        if args.shared_prefix_len > 0:
            prompt = prefixes[i % len(prefixes)] + prompt
        work.append((prompt, olen, 0))
    return work


def run_once(args: argparse.Namespace, work: list[tuple[list[int], int, int]],
             with_checker: bool) -> dict[str, float]:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, policy=args.policy),
        CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
    )
    checker = InvariantChecker(sched) if with_checker else None
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0),
                    eos_token_id=2, priority=pr, arrival_time=0.0)
            for i, (p, o, pr) in enumerate(work)]
    for r in reqs:
        sched.add_request(r)
    vocab_span = args.vocab_size - 100
    requests = sched.requests
    perf = time.perf_counter_ns
    step_ns: list[int] = []
    req_steps = finished = preemptions = 0
    while finished < len(reqs):
        t0 = perf()
        so = sched.schedule()
        if checker is not None:
            checker.on_schedule(so)
        t1 = perf()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for idx, rid in enumerate(req_ids):
            r = requests[rid]
            if r.num_computed_tokens >= r.num_tokens:
                sampled.append([100 + (idx * 7919 + r.num_tokens * 31) % vocab_span])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        t2 = perf()
        outs = sched.update_from_output(so, mro)
        t3 = perf()
        step_ns.append((t1 - t0) + (t3 - t2))
        req_steps += len(req_ids)
        preemptions += len(so.preempted_req_ids)
        finished += sum(1 for o in outs if o.finished)
        if len(step_ns) > 2_000_000:
            raise RuntimeError("runaway loop")
    if checker is not None:
        # The last releases go out in one more (empty) step, as the engine does.
        while sched.has_requests():
            checker.on_schedule(sched.schedule())
        checker.assert_drained()
    total = sum(step_ns)
    return {"steps": len(step_ns), "req_steps": req_steps, "preemptions": preemptions,
            "sched_s": total / 1e9, "us_per_req_step": total / req_steps / 1e3,
            "step_us_median": statistics.median(step_ns) / 1e3}


def run_vllm(args: argparse.Namespace, env_file: str) -> dict[str, float]:
    flags = []
    for name in FORWARDED:
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.shared_prefix_len:
        flags += ["--shared-prefix-len", str(args.shared_prefix_len),
                  "--num-prefixes", str(args.num_prefixes)]
    flags += ["--policy", args.policy]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "vllm.json")
        cmd = (f"source {shlex.quote(env_file)} && \"$VLLM_PY\" {shlex.quote(str(VLLM_HARNESS))} "
               f"{' '.join(map(shlex.quote, flags))} --quiet --json {shlex.quote(out)}")
        subprocess.run(["bash", "-c", cmd], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())["median_run"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    work = make_workload(args)
    run_once(args, work[:64], with_checker=False)  # warm-up
    ours: list[dict[str, float]] = []
    vllm: list[dict[str, float]] = []
    checked: list[dict[str, float]] = []
    for _ in range(args.repeat):
        ours.append(run_once(args, work, with_checker=False))
        if not args.no_checker_run:
            checked.append(run_once(args, work, with_checker=True))
        if args.vllm_env:
            vllm.append(run_vllm(args, args.vllm_env))

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    result: dict[str, object] = {
        "us_per_req_step": med(ours, "us_per_req_step"),
        "steps": int(med(ours, "steps")),
        "preemptions": int(med(ours, "preemptions")),
        "step_us_median": med(ours, "step_us_median"),
        "req_steps": int(med(ours, "req_steps")),
        "repeat": args.repeat,
    }
    print(f"slotserve: {result['steps']} steps, {result['req_steps']} request-steps, "
          f"{result['preemptions']} preemptions")
    print(f"slotserve: median step {result['step_us_median']:.1f} us, "
          f"{result['us_per_req_step']:.2f} us per scheduled request-step (median of {args.repeat})")
    if checked:
        ratio = med(checked, "sched_s") / med(ours, "sched_s")
        result["checker_overhead_ratio"] = ratio
        print(f"checker on/off: {ratio:.2f}x scheduler time")
    if vllm:
        v = med(vllm, "us_per_req_step")
        result["vllm_us_per_req_step"] = v
        result["vllm_steps"] = int(med(vllm, "steps"))
        result["vllm_preemptions"] = int(med(vllm, "preemptions"))
        result["ratio_vs_vllm"] = result["us_per_req_step"] / v  # type: ignore[operator]
        print(f"vLLM 0.33: {result['vllm_steps']} steps, {v:.2f} us per request-step, "
              f"{result['vllm_preemptions']} preemptions")
        print(f"ratio slotserve/vLLM: {result['ratio_vs_vllm']:.2f}x (lower is better)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
