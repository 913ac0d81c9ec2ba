"""Chaos run (issue 11): normal clients against one server, first alone, then mixed with the
hostile and careless patterns of benchmarks/chaos_hostile.py (run in a process of their own).

    python benchmarks/chaos.py --json chaos.json        # about 3 minutes, localhost only
    python benchmarks/chaos.py --only grammars          # one class of hostile patterns

It starts `slotserve serve` on the bundled model (engine core in a child process) with the
engine flags given here, then:

1. warm-up (10 s, not measured) and a clean run of the normal load (--clean-seconds);
2. the same normal load while the hostile patterns run (--chaos-seconds, from when the hostile
   process has imported its libraries; its patterns all start then): garbage numbers and
   unbounded lists, 7 MB prompts and chats, a 6 MB stop-id list, bursts of 256 sequences per
   request, idle WebSocket sessions holding slots, oversized and binary frames, floods,
   input after end, idle sockets, slow headers, slow bodies, uploads cut off midway, the
   admin endpoint;
3. a drain (the hostile clients are gone), then the server's state.

Reported for the normal clients, clean against chaos in the same run: success rate (target
100%), TTFT median and p99, inter-token p99 (ratio target: within 2x); at the end: requests
running / waiting, idle sessions, KV usage and worker slots held (target 0), the server's RSS
growth (front and engine processes) and its log volume; and what the hostile clients got.

The normal load: --normal-clients closed-loop clients, each its own `user`, sending streamed
completions (prompts of 32-128 random tokens, 32-96 output tokens, temperature 0.8) with a
pause of up to 0.2 s between requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from procs import tree_rss_mb  # noqa: E402
from serve_bench import serving  # noqa: E402

from slotserve.entrypoints.cli import add_engine_arguments  # noqa: E402
from slotserve.memory import resident_bytes  # noqa: E402

GAUGES = ("num_requests_running", "num_requests_waiting", "num_paused_sessions",
          "kv_cache_usage_perc", "num_slots_held", "num_requests_admission_waiting")
COUNTERS = ("idle_session_slots_reclaimed_total", "num_preemptions_total",
            "failed_requests_total", "requests_refused_total")


async def normal_client(http: httpx.AsyncClient, index: int, deadline: float,
                        results: list[dict[str, Any]]) -> None:
    rng = random.Random(index * 7919 + int(deadline))
    while time.monotonic() < deadline:
        body = {"prompt": [1] + [rng.randrange(10, 4000) for _ in range(rng.randrange(32, 129))],
                "max_tokens": rng.randrange(32, 97), "temperature": 0.8, "stream": True,
                "ignore_eos": True, "user": f"normal-{index}"}
        start = time.monotonic()
        events: list[float] = []
        error = None
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    error = str(r.status_code)
                    await r.aread()
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            error = data["error"].get("code") or "stream error"
                        elif data["choices"] and data["choices"][0]["text"]:
                            events.append(time.monotonic())
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        results.append({"start": start, "events": events, "error": error,
                        "end": time.monotonic()})
        await asyncio.sleep(rng.uniform(0, 0.2))


async def run_normal(url: str, clients: int, seconds: float) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(normal_client(http, i, deadline, results)
                               for i in range(clients)))
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    ok = [r for r in results if r["error"] is None and r["events"]]
    ttft = [r["events"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["events"], r["events"][1:], strict=False)]
    t0 = min((r["start"] for r in results), default=0.0)
    slowest = sorted(((round(r["start"] - t0, 2), round(1000 * (r["events"][0] - r["start"]), 1))
                      for r in ok), key=lambda x: -x[1])[:5]
    errors: dict[str, int] = {}
    for r in results:
        if r["error"] is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {
        "requests": len(results), "success_rate": len(ok) / max(1, len(results)),
        "ttft_median_ms": 1000 * float(np.median(ttft)) if ttft else float("nan"),
        "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)) if ttft else float("nan"),
        "itl_median_ms": 1000 * float(np.median(itl)) if itl else float("nan"),
        "itl_p99_ms": 1000 * float(np.percentile(itl, 99)) if itl else float("nan"),
        "errors": errors,  # type: ignore[dict-item]
        # The five slowest first tokens: (seconds into the phase when sent, TTFT ms), to tell
        # a tail spread over the run from one stall (the hostile clients' start, a compile).
        "slowest_ttft": slowest,  # type: ignore[dict-item]
    }


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name.removeprefix("slotserve:"): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def sample_max(url: str, seconds: float, peak: dict[str, float]) -> None:
    """The largest value of each gauge over `seconds`, sampled once a second."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            m = scrape(url)
        except httpx.HTTPError:
            continue
        for g in GAUGES:
            peak[g] = max(peak.get(g, 0.0), m.get(g, 0.0))
        time.sleep(1.0)


def wait_drained(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        held = sum(m.get(g, 0.0) for g in GAUGES)
        if held == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(p)
    p.add_argument("--clean-seconds", type=float, default=60.0)
    p.add_argument("--chaos-seconds", type=float, default=100.0)
    p.add_argument("--normal-clients", type=int, default=4)
    p.add_argument("--idle-sessions", type=int, default=None,
                   help="idle WebSocket sessions the hostile side holds (default: 2 x slots)")
    p.add_argument("--server-flag", action="append", default=[],
                   help="an extra `slotserve serve` flag (repeatable), e.g. --server-flag="
                        "--idle-slot-grace=1")
    p.add_argument("--skip", default="", help="hostile patterns left out (chaos_hostile.py "
                   "--skip)")
    p.add_argument("--only", default="", help="the only hostile patterns run, e.g. grammars "
                   "(chaos_hostile.py --only)")
    p.add_argument("--hostile-nice", type=int, default=0,
                   help="run the hostile clients' process at this nice value (e.g. 19): on a "
                        "real deployment they run on other machines, while here they share "
                        "the server's cores and their own CPU would count as server latency")
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process")
    p.add_argument("--json", default=None)
    p.set_defaults(max_num_seqs=16, threads=1)
    args = p.parse_args()
    args.url, args.api_key = None, None
    procs: list[subprocess.Popen[bytes]] = []
    log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)  # noqa: SIM115
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()
                                         if isinstance(v, int | float | str | list)}}
    # A tool-call format, so that the hostile tools (a pydantic-style $ref) reach the grammar.
    flags = tuple(args.server_flag) + (
        () if any(f.startswith("--tool-call-parser") for f in args.server_flag)
        else ("--tool-call-parser", "hermes"))
    with serving(args, flags, procs.append, log) as url:
        server = procs[0]
        print(f"server up at {url}; warm-up", flush=True)
        asyncio.run(run_normal(url, args.normal_clients, 10))
        rss_start = tree_rss_mb(server.pid)
        front_start = resident_bytes(server.pid) / 2**20
        print(f"clean run, {args.clean_seconds:g} s", flush=True)
        clean = asyncio.run(run_normal(url, args.normal_clients, args.clean_seconds))
        rss_clean = tree_rss_mb(server.pid)
        log_before = Path(log.name).stat().st_size
        print(f"chaos run, {args.chaos_seconds:g} s", flush=True)
        hostile = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("chaos_hostile.py")), url,
             "--seconds", str(args.chaos_seconds),
             "--sessions", str(args.idle_sessions or 2 * args.max_num_seqs),
             "--skip", args.skip, "--only", args.only, "--ready-line"],
            stdout=subprocess.PIPE,
            preexec_fn=(lambda: os.nice(args.hostile_nice)) if args.hostile_nice else None)
        # The phase starts when the hostile process has started: its interpreter's start-up
        # (imports, the prebuilt 7 MB bodies: about a second of one core) is not the server's.
        assert hostile.stdout is not None
        hostile.stdout.readline()
        during: dict[str, float] = {}
        sampler = threading.Thread(target=sample_max, args=(url, args.chaos_seconds, during))
        sampler.start()
        chaos = asyncio.run(run_normal(url, args.normal_clients, args.chaos_seconds))
        rss_peak = tree_rss_mb(server.pid)
        sampler.join()
        out, _ = hostile.communicate(timeout=120)
        report["hostile"] = json.loads(out.decode() or "{}")
        final = wait_drained(url)
        rss_end = tree_rss_mb(server.pid)
        front_end = resident_bytes(server.pid) / 2**20
        log_bytes = Path(log.name).stat().st_size - log_before
        log_lines = Path(log.name).read_bytes()[log_before:].count(b"\n")
    report["clean"], report["chaos"] = summarize(clean), summarize(chaos)
    report["end_state"] = {g: final.get(g, 0.0) for g in GAUGES}
    # Kept on purpose (bounded by the engine's cap): what the grammar patterns left behind.
    report["grammar_cache"] = {"entries": final.get("grammar_cache_entries", 0.0),
                               "mb": final.get("grammar_cache_bytes", 0.0) / 2**20}
    report["counters"] = {c: final.get(c, 0.0) for c in COUNTERS}
    report["peak_during_chaos"] = {g: during.get(g, 0.0) for g in GAUGES}
    report["rss_mb"] = {"after_warmup": rss_start, "after_clean": rss_clean,
                        "end_of_chaos": rss_peak, "after_drain": rss_end,
                        "growth": rss_end - rss_start,
                        # Which half grew: the front (its own process) and the engine core.
                        "front_growth": front_end - front_start,
                        "engine_growth": (rss_end - front_end) - (rss_start - front_start)}
    report["server_log"] = {"lines_during_chaos": log_lines, "bytes": log_bytes,
                            "path": log.name}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_report(r: dict[str, Any]) -> None:
    c, x = r["clean"], r["chaos"]
    print("\nnormal clients        clean      chaos     ratio")
    for key, name in (("success_rate", "success rate"), ("ttft_median_ms", "TTFT median ms"),
                      ("ttft_p99_ms", "TTFT p99 ms"), ("itl_median_ms", "ITL median ms"),
                      ("itl_p99_ms", "ITL p99 ms")):
        ratio = x[key] / c[key] if c[key] else float("nan")
        print(f"  {name:18s} {c[key]:9.3f} {x[key]:10.3f} {ratio:8.2f}x")
    print(f"  requests           {c['requests']:9d} {x['requests']:10d}")
    if c["errors"] or x["errors"]:
        print(f"  errors: clean {c['errors']}, chaos {x['errors']}")
    print(f"  slowest TTFT (s into the run, ms): clean {c['slowest_ttft']}, "
          f"chaos {x['slowest_ttft']}")
    print("end state (after the hostile clients left): " + ", ".join(
        f"{k} {v:g}" for k, v in r["end_state"].items()))
    g = r["grammar_cache"]
    print(f"compiled-grammar cache after the drain: {g['entries']:g} entries, "
          f"{g['mb']:.1f} MB charged")
    print("peak during chaos: " + ", ".join(
        f"{k} {v:g}" for k, v in r["peak_during_chaos"].items()))
    print("counters: " + ", ".join(f"{k} {v:g}" for k, v in r["counters"].items()))
    m = r["rss_mb"]
    print(f"server RSS (front + engine): {m['after_warmup']:.0f} MB after warm-up, "
          f"{m['end_of_chaos']:.0f} MB at the end of chaos, {m['after_drain']:.0f} MB after "
          f"the drain: growth {m['growth']:+.0f} MB (front {m['front_growth']:+.0f}, engine "
          f"{m['engine_growth']:+.0f})")
    log = r["server_log"]
    print(f"server log during chaos: {log['lines_during_chaos']} lines, {log['bytes']} bytes "
          f"({log['path']})")
    print("hostile clients got:")
    for pattern, counts in r["hostile"].items():
        print(f"  {pattern:28s} {counts}")


if __name__ == "__main__":
    sys.exit(main())
