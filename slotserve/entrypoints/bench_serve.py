"""`slotserve bench serve`: a load generator for a running OpenAI-compatible server, in the
style of `vllm bench serve`.

    slotserve serve &
    slotserve bench serve --url http://127.0.0.1:8000 --request-rates 2,4,8,inf

A seeded random dataset of token-id prompts (exact input lengths; ignore_eos makes output
lengths exact) is sent at each request rate (Poisson arrivals; `inf` sends everything at
once). Reported per rate: request and output-token throughput, mean / median / p99 of TTFT,
TPOT, ITL and end-to-end latency. `benchmarks/serve_bench.py` starts its own server and adds
the serving-overhead ratio against offline `LLM.generate` measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    """The client's flags; `--model` (the folder the server runs, for the prompts'
    vocabulary) comes from the caller."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"))
    p.add_argument("--served-model-name", default=None)
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
    p.add_argument("--json", default=None, help="write the results here")


# ----------------------------------------------------------------------------- dataset

def model_vocab_size(model: str | None) -> int:
    """Of a Hugging Face folder or a GGUF file (no torch import)."""
    from slotserve.engine.args import DEFAULT_MODEL
    from slotserve.engine.loading import load_model_config

    return load_model_config(model or DEFAULT_MODEL).vocab_size


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


async def run_rate(ep: Endpoint, model: str, requests: list[BenchRequest], rate: float,
                   args: argparse.Namespace, desc: str) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)
    bar = tqdm(total=len(requests), desc=desc, dynamic_ncols=True, leave=False)

    async def one(req: BenchRequest) -> RequestResult:
        async with sem if sem is not None else contextlib.nullcontext():
            res = await send_one(ep, model, req, args.temperature)
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


def run_http(url: str, model: str, requests: list[BenchRequest], rate: float,
             args: argparse.Namespace, desc: str) -> dict[str, Any]:
    """Send every request at `rate` and summarize what came back."""
    results, duration = asyncio.run(run_rate(Endpoint(url, args.api_key), model, requests,
                                             rate, args, desc))
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


# ----------------------------------------------------------------------------- the run

def served_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return str(httpx.get(f"{url}/v1/models", headers=headers,
                         timeout=30).json()["data"][0]["id"])


def parse_rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def warm_up(url: str, model: str, vocab: int, args: argparse.Namespace) -> None:
    warm = make_dataset(args.warmup, args.input_len, args.output_len, 0.0, vocab,
                        args.seed + 1)
    if warm:
        run_http(url, model, warm, math.inf, args, "warmup")


def main(args: argparse.Namespace) -> int:
    vocab = model_vocab_size(args.model)
    requests = make_dataset(args.num_prompts, args.input_len, args.output_len,
                            args.range_ratio, vocab, args.seed)
    url = args.url
    model = args.served_model_name or served_model(url, args.api_key)
    warm_up(url, model, vocab, args)
    results = [run_http(url, model, requests, rate, args, f"rate {rate}")
               for rate in parse_rates(args.request_rates)]
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"url": url, "rates": results}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r["failed"] == 0 for r in results) else 1
