"""Load generator for the OpenAI-compatible server, in the style of `vllm bench serve`.

    python benchmarks/serve_bench.py --num-prompts 200 --request-rates 2,4,8,inf \
        --json serve.json            # starts a server on the bundled model, stops it after
    slotserve bench serve --url http://127.0.0.1:8000 --model PATH ...

A seeded random dataset of token-id prompts (exact input lengths; ignore_eos makes output
lengths exact) is sent at each request rate (Poisson arrivals; `inf` sends everything at
once). Reported per rate: request and output-token throughput, mean / median / p99 of TTFT,
TPOT, ITL and end-to-end latency. The serving overhead is a ratio measured in the same run:
output-token throughput through HTTP at the unbounded rate over `LLM.generate` on the same
requests with the same engine settings. Target: >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Runnable as a script from a checkout: make `slotserve` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from slotserve.entrypoints.cli import add_engine_arguments

    add_engine_arguments(p)  # --model, --threads, ...: the self-started server and offline run
    p.add_argument("--url", default=None,
                   help="a running server; without it one is started on --model and stopped")
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"))
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                   help="where the self-started server runs its engine loop")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--request-rates", default="2,4,8,inf",
                   help="comma-separated requests/s; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=8, help="requests sent before measuring")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating unbounded-rate HTTP and offline runs for the ratio")
    p.add_argument("--no-offline", action="store_true",
                   help="skip the offline LLM.generate baseline (no overhead ratio)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None,
                   help="PNG of latency against request rate (default: next to --json)")


# ----------------------------------------------------------------------------- dataset

def model_vocab_size(model: str | None) -> int:
    from slotserve.engine.args import DEFAULT_MODEL

    config = json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text())
    return int(config["vocab_size"])


def make_dataset(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                 seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    # Ids from the middle of the vocabulary stay clear of the special tokens at either end.
    lo, hi = min(100, vocab // 4), max(min(100, vocab // 4) + 1, vocab - 100)
    return [BenchRequest([rng.randrange(lo, hi) for _ in range(length(input_len))],
                         length(output_len)) for _ in range(n)]


# ----------------------------------------------------------------------------- HTTP client

class Endpoint:
    """Where the completions requests go, parsed once from --url."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path.rstrip("/") + "/v1/completions"
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""


async def stream_events(ep: Endpoint, payload: bytes) -> AsyncIterator[bytes]:
    """POST and yield the SSE events of the response.

    A bare asyncio HTTP/1.1 client rather than httpx: the load generator shares the machine
    with the server, and every CPU cycle it spends per streamed token is taken from the
    server being measured (httpx spent about twice the server's own time per token).
    """
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    try:
        writer.write((f"POST {ep.path} HTTP/1.1\r\nHost: {ep.host}:{ep.port}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                      f"Connection: close\r\n{ep.auth}\r\n").encode() + payload)
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(300))!r}")
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                buf += (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                yield event
    finally:
        writer.close()


async def send_one(ep: Endpoint, model: str, req: BenchRequest, temperature: float
                   ) -> RequestResult:
    payload = json.dumps({
        "model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
        "temperature": temperature, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async for event in stream_events(ep, payload):
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            now = time.perf_counter()
            # Only the error and usage events are parsed, for the same reason.
            if event.startswith(b'data: {"error"'):
                result.error = json.loads(event[6:])["error"]["message"]
                return result
            if b'"usage":{' in event:
                result.output_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
            if b'"text":""' not in event and b'"choices":[]' not in event:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


async def run_rate(url: str, model: str, api_key: str | None, requests: list[BenchRequest],
                   rate: float, max_concurrency: int | None, temperature: float, seed: int,
                   desc: str) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm

    ep = Endpoint(url, api_key)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    bar = tqdm(total=len(requests), desc=desc, dynamic_ncols=True, leave=False)

    async def one(req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send_one(ep, model, req, temperature)
        else:
            async with sem:
                res = await send_one(ep, model, req, temperature)
        bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": 1000 * statistics.fmean(ordered), "median": 1000 * statistics.median(ordered),
            "p99": 1000 * p99}


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "request_rate": "inf" if not math.isfinite(rate) else rate,
        "completed": len(ok), "failed": len(errors), "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }


# ----------------------------------------------------------------------------- server + offline

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_cli_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in ("model", "dtype", "device", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "block_size", "num_blocks", "kv_cache_memory",
                 "policy", "threads"):
        value = getattr(args, name, None)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "no_prefix_caching", False):
        flags.append("--no-prefix-caching")
    return flags


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--port", str(port),
           "--log-level", "warning", "--engine-mode", args.engine_mode,
           *engine_cli_flags(args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy within 300 s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def served_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


class OfflineRunner:
    """The same requests through LLM.generate, with the engine settings of the server."""

    def __init__(self, args: argparse.Namespace, requests: list[BenchRequest]) -> None:
        from slotserve.entrypoints.cli import engine_kwargs_from_args, set_threads
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


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'rate':>6} {'req/s':>7} {'tok/s':>9} | {'TTFT mean/med/p99 ms':>22} | "
          f"{'TPOT mean/med/p99':>20} | {'ITL mean/med/p99':>20} | {'E2E mean/med/p99':>22}")
    def f(r: dict[str, Any], k: str) -> str:
        v = r[k]
        return f"{v['mean']:.1f}/{v['median']:.1f}/{v['p99']:.1f}"

    for r in results:
        print(f"{r['request_rate']!s:>6} {r['request_throughput']:7.2f} "
              f"{r['output_throughput']:9.1f} | {f(r, 'ttft_ms'):>22} | {f(r, 'tpot_ms'):>20} | "
              f"{f(r, 'itl_ms'):>20} | {f(r, 'e2e_ms'):>22}")


def main(args: argparse.Namespace) -> int:
    rates = [float(x) for x in args.request_rates.split(",") if x.strip()]
    if not any(math.isinf(r) for r in rates):
        rates.append(math.inf)  # the overhead ratio is measured at the unbounded rate
    vocab = model_vocab_size(args.model)
    requests = make_dataset(args.num_prompts, args.input_len, args.output_len,
                            args.range_ratio, vocab, args.seed)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    unbounded_runs: list[dict[str, Any]] = []
    offline_runs: list[float] = []
    try:
        model = args.served_model_name or served_model(url, args.api_key)

        def http_run(rate: float, label: str) -> dict[str, Any]:
            before = engine_loop_counters(url, args.api_key)
            res, duration = asyncio.run(run_rate(
                url, model, args.api_key, requests, rate, args.max_concurrency,
                args.temperature, args.seed, label))
            summary = summarize(rate, res, duration)
            summary["engine_loop"] = loop_usage(before, engine_loop_counters(url, args.api_key),
                                                duration)
            return summary

        warm = make_dataset(args.warmup, args.input_len, args.output_len, 0.0, vocab,
                            args.seed + 1)
        if warm:
            asyncio.run(run_rate(url, model, args.api_key, warm, math.inf, None,
                                 args.temperature, args.seed, "warmup"))
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
    finally:
        if proc is not None:
            stop_server(proc)
    print_table(results)
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
        "url": url, "started_server": proc is not None,
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
