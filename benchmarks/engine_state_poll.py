"""What polling GET /v1/engine/state costs (issue 20): the web page asks once a second.

    python benchmarks/engine_state_poll.py            # about a minute, localhost only

It starts `slotserve serve` on the bundled model (engine core in a child process, as by
default), then, in the same run:

1. latency on an idle server: median of --requests GETs of /v1/engine/state against the
   same for /v1/models (a route that never reaches the engine core);
2. throughput under load: --clients closed-loop clients streaming completions (ignore_eos,
   --max-tokens each) for --seconds, without a poller and with one asking every
   --poll-interval seconds (ten times the page's rate by default), alternating, --rounds
   times each; the medians of output tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import free_port, stop, wait_healthy  # noqa: E402


async def _latency(http: httpx.AsyncClient, path: str, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        r = await http.get(path)
        r.raise_for_status()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _client(http: httpx.AsyncClient, end: float, max_tokens: int) -> int:
    tokens = 0
    while time.monotonic() < end:
        r = await http.post("/v1/completions", json={
            "prompt": "To be, or not", "max_tokens": max_tokens, "ignore_eos": True})
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]
    return tokens


async def _poller(http: httpx.AsyncClient, end: float, interval: float) -> int:
    polls = 0
    while time.monotonic() < end:
        (await http.get("/v1/engine/state")).raise_for_status()
        polls += 1
        await asyncio.sleep(interval)
    return polls


async def _round(http: httpx.AsyncClient, args: argparse.Namespace, poll: bool) -> float:
    start = time.monotonic()
    end = start + args.seconds
    clients = [_client(http, end, args.max_tokens) for _ in range(args.clients)]
    results = await asyncio.gather(*clients, *([_poller(http, end, args.poll_interval)]
                                               if poll else []))
    return sum(results[:args.clients]) / (time.monotonic() - start)


async def _main(base: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        await _latency(http, "/v1/engine/state", 20)  # warm-up
        state = await _latency(http, "/v1/engine/state", args.requests)
        models = await _latency(http, "/v1/models", args.requests)
        print(f"idle latency (median of {args.requests}): /v1/engine/state "
              f"{state * 1e3:.2f} ms, /v1/models {models * 1e3:.2f} ms, "
              f"ratio {state / models:.2f}")
        await _round(http, args, False)  # warm-up
        plain, polled = [], []
        for _ in range(args.rounds):
            plain.append(await _round(http, args, False))
            polled.append(await _round(http, args, True))
        p, q = statistics.median(plain), statistics.median(polled)
        print(f"output tok/s, {args.clients} clients (median of {args.rounds} rounds): "
              f"no poller {p:.1f}, polled every {args.poll_interval:g} s {q:.1f}, "
              f"ratio {q / p:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--poll-interval", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--port", str(port),
         "--threads", str(args.threads), "--log-level", "warning"],
        cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 300, poll_s=0.2)
        asyncio.run(_main(base, args))
    finally:
        stop(proc, signal.SIGTERM)


if __name__ == "__main__":
    main()
