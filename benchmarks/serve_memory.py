"""Resident memory of `slotserve serve` per process (the front, the engine core child) after one
greedy request, from /proc/PID/smaps_rollup: RSS, and its anonymous part (what the process
allocated, as opposed to mapped library and model files).

    .venv/bin/python benchmarks/serve_memory.py [--model PATH] [-- extra serve flags]

The default model is the real Gemma 3 270M GGUF; the server runs one slot and one thread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import free_port, gemma_file, stop, wait_healthy  # noqa: E402

SLOTSERVE = Path(sys.executable).parent / "slotserve"
FIELDS = ("Rss", "Anonymous")


def rollup_mb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, *rest = line.split()
            if key.rstrip(":") in FIELDS:
                out[key.rstrip(":")] = int(rest[0]) // 1024
    return out


def tree(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid] + [p for k in kids for p in tree(int(k))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("extra", nargs="*", help="more `slotserve serve` flags (after --)")
    args = parser.parse_args(argv)
    port = free_port()
    cmd = [str(SLOTSERVE), "serve", "--model", args.model or gemma_file(), "--port", str(port),
           "--threads", "1", "--max-num-seqs", "1", "--log-level", "warning", *args.extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 300.0)
        body = json.dumps({"prompt": "Hello " * 100, "max_tokens": args.max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        usage = json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]
        print(f"after one request ({usage['prompt_tokens']} prompt + "
              f"{usage['completion_tokens']} generated tokens):")
        total = 0
        for pid in tree(proc.pid):
            name = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[-2][:40]
            mem = rollup_mb(pid)
            total += mem["Rss"]
            print(f"  pid {pid:7d} rss {mem['Rss']:5d} MB  anonymous {mem['Anonymous']:5d} MB"
                  f"  {name}")
        print(f"  total rss {total} MB")
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
