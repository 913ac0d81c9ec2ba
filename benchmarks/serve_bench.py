"""The serving benchmark: `slotserve bench serve` (slotserve/entrypoints/bench_serve.py) plus
the serving-overhead ratio against offline `LLM.generate` and a latency plot.

    python benchmarks/serve_bench.py --num-prompts 200 --request-rates 2,4,8,inf \
        --json serve.json            # starts a server on the bundled model, stops it after

A seeded random dataset of token-id prompts (exact input lengths; ignore_eos makes output
lengths exact) is sent at each request rate (Poisson arrivals; `inf` sends everything at
once). Reported per rate: request and output-token throughput, mean / median / p99 of TTFT,
TPOT, ITL and end-to-end latency. The serving overhead is a ratio measured in the same run:
output-token throughput through HTTP at the unbounded rate over `LLM.generate` on the same
requests with the same engine settings. Target: >= 0.9.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Runnable as a script from a checkout: make `slotserve` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from procs import free_port, stop, wait_healthy  # noqa: E402

from slotserve.entrypoints import bench_serve as client  # noqa: E402
from slotserve.entrypoints.cli import (  # noqa: E402
    add_engine_arguments,
    engine_flags,
    engine_kwargs_from_args,
    set_threads,
)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)  # --model, --threads, ...: the self-started server and offline run
    client.add_cli_args(p)
    p.set_defaults(url=None)  # a server started here on the engine flags
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                   help="where the started server runs its engine core")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating unbounded-rate HTTP and offline runs for the ratio")
    p.add_argument("--no-offline", action="store_true",
                   help="skip the offline LLM.generate baseline (no overhead ratio)")
    p.add_argument("--plot", default=None,
                   help="PNG of latency against request rate (default: next to --json)")


def engine_cli_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as `slotserve serve` takes them: the same settings the
    offline baseline gets from engine_kwargs_from_args."""
    flags = engine_flags(engine_kwargs_from_args(args))
    if args.threads is not None:
        flags += ["--threads", str(args.threads)]
    return flags


@contextlib.contextmanager
def serving(args: argparse.Namespace, extra_flags: tuple[str, ...] = (),
            on_start: Any = None, log: Any = None) -> Iterator[str]:
    """The URL of --url, or of a server started here on the engine flags and `extra_flags`
    (stopped after); `on_start(proc)` is called with the started process, whose output goes
    to the file `log` when given."""
    if args.url is not None:
        yield args.url
        return
    port = free_port()
    cmd = [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--port", str(port),
           "--log-level", "warning", "--engine-mode", args.engine_mode,
           *engine_cli_flags(args), *extra_flags] + (
               ["--api-key", args.api_key] if args.api_key else [])
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=log,
                            stderr=None if log is None else subprocess.STDOUT)
    if on_start is not None:
        on_start(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 300, poll_s=0.2)
        yield url
    finally:
        stop(proc, signal.SIGTERM)


def engine_loop_counters(url: str, api_key: str | None) -> dict[str, float]:
    """The server's engine-loop counters from /metrics (how busy HTTP keeps the step loop)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return {}
    wanted = {"slotserve:engine_loop_steps_total": "steps",
              "slotserve:engine_loop_busy_seconds_total": "busy_s",
              "slotserve:engine_loop_busy_cpu_seconds_total": "busy_cpu_s"}
    return {wanted[s.name]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in wanted}


def loop_usage(before: dict[str, float], after: dict[str, float],
               duration: float) -> dict[str, float]:
    if not before or not after:
        return {}
    steps = max(1.0, after["steps"] - before["steps"])
    busy = after["busy_s"] - before["busy_s"]
    cpu = after["busy_cpu_s"] - before["busy_cpu_s"]
    return {"steps": steps, "busy_frac": busy / duration, "cpu_frac": cpu / duration,
            "step_ms": 1000 * busy / steps, "step_cpu_ms": 1000 * cpu / steps}


class OfflineRunner:
    """The same requests through LLM.generate, with the engine settings of the server."""

    def __init__(self, args: argparse.Namespace, requests: list[client.BenchRequest]) -> None:
        from slotserve.entrypoints.llm import LLM
        from slotserve.sampling_params import SamplingParams

        set_threads(args.threads)
        self.llm = LLM(**engine_kwargs_from_args(args))
        self.prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        self.params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                                      temperature=args.temperature) for r in requests]
        warm = min(args.warmup, len(requests))
        if warm:
            self.llm.generate(self.prompts[:warm], self.params[:warm], use_tqdm=False)

    def run(self) -> float:
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["request_throughput"] for r in results]
    labels = [str(r["request_rate"]) for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"),
                              ("time to first token", "time per output token",
                               "end-to-end latency"), strict=True):
        ax.plot(xs, [r[key]["median"] for r in results], "o-", label="median")
        ax.plot(xs, [r[key]["p99"] for r in results], "s--", label="p99")
        for x, y, label in zip(xs, [r[key]["median"] for r in results], labels, strict=True):
            ax.annotate(f"rate {label}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("slotserve: latency against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    rates = client.parse_rates(args.request_rates)
    if not any(math.isinf(r) for r in rates):
        rates.append(math.inf)  # the overhead ratio is measured at the unbounded rate
    vocab = client.model_vocab_size(args.model)
    requests = client.make_dataset(args.num_prompts, args.input_len, args.output_len,
                                   args.range_ratio, vocab, args.seed)
    offline_runs: list[float] = []
    with serving(args) as url:
        model = args.served_model_name or client.served_model(url, args.api_key)

        def http_run(rate: float, label: str) -> dict[str, Any]:
            before = engine_loop_counters(url, args.api_key)
            summary = client.run_http(url, model, requests, rate, args, label)
            summary["engine_loop"] = loop_usage(before, engine_loop_counters(url, args.api_key),
                                                summary["duration_s"])
            return summary

        client.warm_up(url, model, vocab, args)
        results = [http_run(rate, f"rate {rate}") for rate in rates]
        unbounded_runs = [next(r for r in results if r["request_rate"] == "inf")]
        if not args.no_offline:
            # HTTP and offline runs alternate, so a change in background load between
            # them (a shared machine) moves both sides of the ratio alike.
            offline = OfflineRunner(args, requests)
            for k in range(args.repeats):
                if k:
                    unbounded_runs.append(http_run(math.inf, f"http {k + 1}/{args.repeats}"))
                offline_runs.append(offline.run())
    client.print_table(results)
    unbounded = next(r for r in results if r["request_rate"] == "inf")
    http_runs = [r["output_throughput"] for r in unbounded_runs]
    loop = [r["engine_loop"] for r in unbounded_runs if r.get("engine_loop")]
    if loop:
        print("engine loop at the unbounded rate: "
              + "; ".join(f"busy {u['busy_frac']:.0%} of wall ({u['cpu_frac']:.0%} on CPU), "
                          f"{u['step_ms']:.1f} ms/step ({u['step_cpu_ms']:.1f} CPU)"
                          for u in loop))
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "url": url, "started_server": args.url is None,
        "http_tok_s": statistics.median(http_runs), "http_tok_s_runs": http_runs,
        "ttft_ms": unbounded["ttft_ms"], "tpot_ms": unbounded["tpot_ms"],
        "itl_ms": unbounded["itl_ms"], "e2e_ms": unbounded["e2e_ms"],
        "engine_loop": loop,
        "rates": results,
    }
    if offline_runs:
        report["offline_tok_s"] = statistics.median(offline_runs)
        report["offline_tok_s_runs"] = offline_runs
        report["ratio"] = report["http_tok_s"] / report["offline_tok_s"]
        report["ratio_runs"] = [h / o for h, o in zip(http_runs, offline_runs, strict=False)]
        print(f"serving overhead: HTTP {report['http_tok_s']:.1f} tok/s / offline "
              f"{report['offline_tok_s']:.1f} tok/s = ratio {report['ratio']:.3f} "
              f"(target >= 0.9; medians of {len(offline_runs)} alternating runs: "
              f"{', '.join(f'{r:.3f}' for r in report['ratio_runs'])})")
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot_path:
        plot(results, plot_path)
        report["plot"] = plot_path
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
