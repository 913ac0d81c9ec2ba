"""slotserve against llama.cpp's `llama-server` on the same GGUF file, measured in the same run.

For each concurrency (default 1, 8, 32), each server is started on its own with 1 thread
(llama-server: continuous batching, `--parallel` = the concurrency; slotserve serve:
`--max-num-seqs` = the concurrency), warmed up, sent the same seeded requests through the same
client (`slotserve bench serve`'s: prompts of 128 random token ids, 128 output tokens,
`ignore_eos`, greedy, streamed, at most `concurrency` in flight), and stopped; the two servers
alternate which goes first, round by round, and the medians over rounds are reported. Both get
a KV cache of the same number of tokens: `concurrency * (prompt + output + 16)`.

Printed per concurrency: output tokens/s, TTFT and TPOT median and p99, each server's peak
resident memory (its whole process tree, sampled every 0.1 s while it serves), and the ratio
slotserve / llama.cpp. Printed once: the floor of one sequence's TPOT, the bytes of weights a
decode step reads (every tensor of the file once; the tied embedding once, as the output
projection) over the single-core read bandwidth measured in the same run (a large-buffer sum,
best of 5, taken before each concurrency and at the end: the best of them), and each server's
TPOT at concurrency 1 over that floor. `--cpu-level v3` runs slotserve's kernels built for
that level (SLOTSERVE_CPU_LEVEL, e.g. the AVX2 code on an AVX-512 machine) against llama.cpp
built for AVX2 alone (`setup_llamacpp.sh --avx2`), as a user on an AVX2-only CPU would run
both. `--offline` adds a row per concurrency without HTTP: slotserve's
`LLM.generate` against `llama-batched-bench` (the concurrency as its parallel sequences, the
same prompt and output lengths). `--json PATH` writes
`{"rows": [{"concurrency", "slotserve_tok_s", "llamacpp_tok_s", "ratio", ...}],
"rss_mb": {"slotserve", "llamacpp"}}` (rss_mb: the peak over all rows).

    bash benchmarks/setup_llamacpp.sh          # once: builds llama-server (about 15 min)
    bash benchmarks/setup_llamacpp.sh --avx2   # once, for --cpu-level v3: the AVX2 build
    .venv/bin/python benchmarks/vs_llamacpp.py [--llama-server PATH] [--model PATH]
        [--concurrency 1,8,32] [--rounds 2] [--requests-per-slot 2] [--threads 1]
        [--quantization auto|exact|none] [--cpu-level v3] [--offline] [--json out.json]

Not part of the test suite: it takes minutes and wants a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from procs import RssSampler, free_port, gemma_file, wait_healthy  # noqa: E402

from slotserve.config import QUANTIZATION_MODES  # noqa: E402
from slotserve.entrypoints import bench_serve  # noqa: E402

SLOTSERVE = Path(sys.executable).parent / "slotserve"
LLAMACPP_DIR = Path(os.environ.get("LLAMACPP_DIR", Path.home() / "llamacpp"))
CTX_MARGIN = 16  # tokens of KV per sequence beyond prompt + output, for both servers


class Server:
    """One server process: started, waited for, stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str]) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(f"/tmp/vs_llamacpp_{name}_{port}.log")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        wait_healthy(self.proc, self.url, timeout, poll_s=0.1, name=self.name, log=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_llamacpp(args: argparse.Namespace, concurrency: int) -> Server:
    port = free_port()
    ctx = concurrency * (args.prompt_len + args.output_len + CTX_MARGIN)
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(concurrency),
           "-c", str(ctx), "-cb", "--no-webui"]
    return Server("llamacpp", cmd, port, dict(os.environ))


def start_slotserve(args: argparse.Namespace, concurrency: int) -> Server:
    port = free_port()
    per_seq = args.prompt_len + args.output_len + CTX_MARGIN
    blocks = concurrency * math.ceil(per_seq / 16) + 1
    cmd = [str(SLOTSERVE), "serve", "--model", args.model, "--port", str(port),
           "--threads", str(args.threads), "--max-num-seqs", str(concurrency),
           "--max-model-len", str(per_seq), "--num-blocks", str(blocks), "--block-size", "16",
           "--engine-mode", args.engine_mode, "--quantization", args.quantization,
           "--log-level", "warning", *args.slotserve_args.split()]
    return Server("slotserve", cmd, port, slotserve_env(args))


def slotserve_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.cpu_level:
        env["SLOTSERVE_CPU_LEVEL"] = args.cpu_level
    return env


def weight_bytes(model: str) -> int:
    """Bytes of weights one decode step reads: every tensor in the file once."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(model).tensors)


def read_bandwidth(mib: int = 1024, rounds: int = 5) -> float:
    """Single-core read bandwidth in bytes/s: the best of `rounds` sums of a buffer far
    larger than the caches (in a child with one thread, so nothing else runs with it)."""
    code = ("import time, torch\ntorch.set_num_threads(1)\n"
            f"x = torch.ones({mib} * 2**18)\nbest = 1e9\n"
            f"for _ in range({rounds}):\n    t = time.perf_counter(); x.sum().item()\n"
            "    best = min(best, time.perf_counter() - t)\n"
            "print(x.numel() * 4 / best)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return float(res.stdout.strip())


def serve_round(server: Server, args: argparse.Namespace, concurrency: int,
                requests: list[bench_serve.BenchRequest]) -> dict[str, Any]:
    try:
        server.wait_healthy()
        model = bench_serve.served_model(server.url, None)
        client = argparse.Namespace(max_concurrency=concurrency, seed=args.seed,
                                    temperature=0.0, api_key=None)
        warm = requests[:min(len(requests), concurrency, 4)]
        bench_serve.run_http(server.url, model, warm, math.inf, client, "warmup")
        sampler = RssSampler(server.proc.pid)
        result = bench_serve.run_http(server.url, model, requests, math.inf, client,
                                      f"{server.name} c={concurrency}")
        result["rss_mb"] = sampler.stop()
    finally:
        server.stop()
    if result["failed"]:
        raise SystemExit(f"{server.name}: {result['failed']} requests failed: "
                         f"{result['errors']}")
    return result


# ----------------------------------------------------------------------------- offline row

def offline_slotserve(args: argparse.Namespace, concurrency: int,
                      requests: list[bench_serve.BenchRequest]) -> float:
    """Output tokens/s of LLM.generate on the requests (in a child: its own memory)."""
    code = (
        "import json, sys, time, torch\n"
        f"torch.set_num_threads({args.threads})\n"
        "from slotserve.entrypoints.llm import LLM\n"
        "from slotserve.sampling_params import SamplingParams\n"
        "cfg = json.loads(sys.stdin.read())\n"
        "llm = LLM(model=cfg['model'], max_num_seqs=cfg['c'], quantization=cfg['q'],\n"
        "          max_model_len=cfg['len'], num_blocks=cfg['blocks'])\n"
        "sp = SamplingParams(max_tokens=cfg['out'], temperature=0.0, ignore_eos=True)\n"
        "prompts = [{'prompt_token_ids': p} for p in cfg['prompts']]\n"
        "llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), "
        "use_tqdm=False)\n"
        "t = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False)\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps(sum(len(o.outputs[0].token_ids) for o in outs) / dt))\n")
    per_seq = args.prompt_len + args.output_len + CTX_MARGIN
    cfg = {"model": args.model, "c": concurrency, "q": args.quantization, "len": per_seq,
           "blocks": concurrency * math.ceil(per_seq / 16) + 1, "out": args.output_len,
           "prompts": [r.prompt_token_ids for r in requests]}
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(cfg), text=True,
                         capture_output=True, env=slotserve_env(args), check=True)
    return float(res.stdout.strip().splitlines()[-1])


def offline_llamacpp(args: argparse.Namespace, concurrency: int, num_requests: int) -> float:
    """Output tokens/s of llama-batched-bench with `concurrency` parallel sequences, run for
    as many batches as the HTTP run has waves of requests."""
    binary = Path(args.llama_server).with_name("llama-batched-bench")
    ctx = concurrency * (args.prompt_len + args.output_len + CTX_MARGIN)
    cmd = [str(binary), "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len),
           "-ntg", str(args.output_len), "-npl", str(concurrency), "--output-format", "jsonl"]
    res = subprocess.run(cmd, text=True, capture_output=True, check=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"llama-batched-bench printed no results:\n{res.stderr[-2000:]}")
    row = rows[-1]
    # One batch: prefill of every prompt, then output_len decode steps of all sequences.
    return float(concurrency * args.output_len / float(row["t"]))


# ----------------------------------------------------------------------------- the run

def median_of(results: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in results:
        v: Any = r
        for key in path:
            v = v[key]
        values.append(float(v))
    return statistics.median(values)


def summarize(concurrency: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": concurrency}
    for name in ("slotserve", "llamacpp"):
        rs = runs[name]
        row[f"{name}_tok_s"] = median_of(rs, "output_throughput")
        row[f"{name}_ttft_ms"] = {"median": median_of(rs, "ttft_ms", "median"),
                                  "p99": median_of(rs, "ttft_ms", "p99")}
        row[f"{name}_tpot_ms"] = {"median": median_of(rs, "tpot_ms", "median"),
                                  "p99": median_of(rs, "tpot_ms", "p99")}
        row[f"{name}_rss_mb"] = max(r["rss_mb"] for r in rs)
        row[f"{name}_rounds_tok_s"] = [r["output_throughput"] for r in rs]
    row["ratio"] = row["slotserve_tok_s"] / row["llamacpp_tok_s"]
    row["rss_ratio"] = row["slotserve_rss_mb"] / row["llamacpp_rss_mb"]
    return row


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'conc':>4} | {'slotserve tok/s':>15} {'llama.cpp tok/s':>15} {'ratio':>6} | "
          f"{'TTFT med/p99 ms (slot | llama)':>32} | {'TPOT med/p99 ms (slot | llama)':>30} | "
          f"{'RSS MB (slot | llama)':>22}")
    def lat(r: dict[str, Any], k: str) -> str:
        s, ll = r[f"slotserve_{k}"], r[f"llamacpp_{k}"]
        return f"{s['median']:.0f}/{s['p99']:.0f} | {ll['median']:.0f}/{ll['p99']:.0f}"

    for r in rows:
        print(f"{r['concurrency']:>4} | {r['slotserve_tok_s']:15.1f} {r['llamacpp_tok_s']:15.1f} "
              f"{r['ratio']:5.2f}x | {lat(r, 'ttft_ms'):>32} | {lat(r, 'tpot_ms'):>30} | "
              f"{r['slotserve_rss_mb']:7.0f} | {r['llamacpp_rss_mb']:7.0f}")
        if "offline_slotserve_tok_s" in r:
            print(f"     offline: LLM.generate {r['offline_slotserve_tok_s']:.1f} tok/s, "
                  f"llama-batched-bench {r['offline_llamacpp_tok_s']:.1f} tok/s, ratio "
                  f"{r['offline_ratio']:.2f}x")


def print_floor(args: argparse.Namespace, rows: list[dict[str, Any]],
                bandwidths: list[float]) -> dict[str, Any]:
    """The floor from the best read bandwidth of the run: measured before each concurrency's
    servers and at the end (one reading taken while a server's processes were still going
    away once came out 24 against 34 GB/s a minute later, flattering every ratio to it)."""
    bandwidths = [*bandwidths, read_bandwidth()]
    nbytes, bw = weight_bytes(args.model), max(bandwidths)
    floor_ms = 1e3 * nbytes / bw
    out = {"weight_bytes": nbytes, "read_bytes_per_s": bw, "floor_tpot_ms": floor_ms,
           "read_bytes_per_s_all": bandwidths}
    print(f"\nfloor: {nbytes / 2**20:.0f} MiB of weights per decode step / {bw / 1e9:.1f} GB/s "
          f"single-core read = {floor_ms:.1f} ms a token ({1e3 / floor_ms:.0f} tok/s); "
          f"read bandwidth over the run: {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)} "
          "GB/s, the best taken")
    for r in rows:
        if r["concurrency"] == 1:
            for name in ("slotserve", "llamacpp"):
                tpot = r[f"{name}_tpot_ms"]["median"]
                out[f"{name}_tpot_over_floor"] = tpot / floor_ms
                print(f"  {name}: TPOT {tpot:.1f} ms = {tpot / floor_ms:.2f}x the floor")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=None,
                   help="default: DIR/build/bin/llama-server, or with --cpu-level v3 the AVX2 "
                   "build, DIR/build-avx2/bin/llama-server (setup_llamacpp.sh --avx2)")
    p.add_argument("--model", default=None, help="GGUF file (default: the Gemma package's)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests per concurrency slot (at least 4 requests in all)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process")
    p.add_argument("--quantization", choices=QUANTIZATION_MODES, default="auto")
    p.add_argument("--cpu-level", default=None,
                   help="slotserve's kernels built for this CPU level (e.g. v3: AVX2)")
    p.add_argument("--slotserve-args", default="", help="extra `slotserve serve` flags")
    p.add_argument("--offline", action="store_true", help="add the offline rows")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.model = args.model or gemma_file()
    # A user on an AVX2-only CPU runs llama.cpp's AVX2 code too: the v3 row races that build.
    avx2 = args.cpu_level == "v3"
    if args.llama_server is None:
        args.llama_server = str(LLAMACPP_DIR / ("build-avx2" if avx2 else "build")
                                / "bin/llama-server")
    if not Path(args.llama_server).is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: run "
                         f"benchmarks/setup_llamacpp.sh{' --avx2' if avx2 else ''} or pass "
                         "--llama-server")
    print(f"llama-server: {args.llama_server}", flush=True)
    vocab = int(json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from slotserve.engine.loading import "
         f"load_model_config as f; print(f({args.model!r}).vocab_size)"],
        capture_output=True, text=True, check=True).stdout.strip()))
    starters = {"llamacpp": start_llamacpp, "slotserve": start_slotserve}
    rows = []
    bandwidths: list[float] = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        bandwidths.append(read_bandwidth())
        n = max(4, c * args.requests_per_slot)
        requests = bench_serve.make_dataset(n, args.prompt_len, args.output_len, 0.0, vocab,
                                            args.seed + c)
        runs: dict[str, list[dict[str, Any]]] = {"slotserve": [], "llamacpp": []}
        for r in range(args.rounds):
            order = ["llamacpp", "slotserve"] if r % 2 == 0 else ["slotserve", "llamacpp"]
            for name in order:
                res = serve_round(starters[name](args, c), args, c, requests)
                runs[name].append(res)
                print(f"c={c} round {r + 1} {name}: {res['output_throughput']:.1f} tok/s, "
                      f"peak RSS {res['rss_mb']:.0f} MB", flush=True)
        row = summarize(c, runs)
        if args.offline:
            row["offline_slotserve_tok_s"] = offline_slotserve(args, c, requests)
            row["offline_llamacpp_tok_s"] = offline_llamacpp(args, c, n)
            row["offline_ratio"] = row["offline_slotserve_tok_s"] / row["offline_llamacpp_tok_s"]
        rows.append(row)
    print_rows(rows)
    floor = print_floor(args, rows, bandwidths)
    out = {"rows": rows, "floor": floor, "rss_mb": {"slotserve": max(r["slotserve_rss_mb"] for r in rows),
                                    "llamacpp": max(r["llamacpp_rss_mb"] for r in rows)},
           "model": args.model, "threads": args.threads, "prompt_len": args.prompt_len,
           "output_len": args.output_len, "rounds": args.rounds,
           "engine_mode": args.engine_mode, "quantization": args.quantization,
           "cpu_level": args.cpu_level,
           "llama_server": args.llama_server,
           "llama_server_version": llama_version(args.llama_server)}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0


def llama_version(binary: str) -> str:
    res = subprocess.run([binary, "--version"], capture_output=True, text=True)
    found = re.search(r"version: (.*)", res.stdout + res.stderr)
    return found.group(1).strip() if found else "unknown"


if __name__ == "__main__":
    sys.exit(main())
