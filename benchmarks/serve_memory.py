"""Resident memory of `slotserve serve` per process (the front, the engine core child, the
chat-template child when one runs) after `--concurrency` greedy requests at once, from
/proc/PID/smaps_rollup: RSS, and its anonymous part (what the process allocated, as opposed to
mapped library and model files). `--mappings` adds each process's RSS by mapping kind from
/proc/PID/smaps: the model file (mapped weights), torch's libraries, other native libraries,
the Python binary, the heap and anonymous memory (tensors, the KV pool, Python objects), and
the largest single mappings. Also printed: the tree's peak RSS while the requests ran,
sampled as vs_llamacpp.py samples it.

    .venv/bin/python benchmarks/serve_memory.py [--model PATH] [--concurrency 1]
        [--mappings] [-- extra serve flags]

The default model is the real Gemma 3 270M GGUF; the server runs one thread and the KV cache
that vs_llamacpp.py gives it at that concurrency (prompt + output + 16 tokens a slot).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import RssSampler, free_port, gemma_file, stop, wait_healthy  # noqa: E402

SLOTSERVE = Path(sys.executable).parent / "slotserve"
FIELDS = ("Rss", "Anonymous")
CTX_MARGIN = 16  # as vs_llamacpp.py
_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def rollup_mb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, *rest = line.split()
            if key.rstrip(":") in FIELDS:
                out[key.rstrip(":")] = int(rest[0]) // 1024
    return out


def mapping_kind(path: str) -> str:
    if not path:
        return "anonymous"
    if path.endswith(".gguf") or path.endswith(".safetensors"):
        return "model file"
    if "/torch/" in path:
        return "torch libraries"
    if path.startswith("[heap]"):
        return "heap"
    if re.search(r"/(python3[.0-9]*|libpython[^/]*)$", path):
        return "python binary"
    if ".so" in path:
        return "other libraries"
    if path.startswith("["):
        return "stack and vdso"
    return "other files"


def mappings_kb(pid: int) -> Counter[str]:
    """RSS in kB per mapped path ("" for anonymous mappings), from /proc/PID/smaps."""
    out: Counter[str] = Counter()
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
            elif line.startswith("Rss:"):
                out[path] += int(line.split()[1])
    return out


def print_mappings(pid: int, top: int = 6) -> None:
    per_path = mappings_kb(pid)
    kinds: Counter[str] = Counter()
    for path, kb in per_path.items():
        kinds[mapping_kind(path)] += kb
    print("      by kind: " + ", ".join(f"{k} {v // 1024} MB" for k, v in kinds.most_common()
                                         if v >= 1024))
    for path, kb in per_path.most_common(top):
        print(f"      {kb // 1024:5d} MB  {Path(path).name if path else '(anonymous)'}")


def tree(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid] + [p for k in kids for p in tree(int(k))]


def complete(url: str, max_tokens: int) -> dict[str, int]:
    body = json.dumps({"prompt": "Hello " * 100, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    usage: dict[str, int] = json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]
    return usage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--mappings", action="store_true",
                        help="RSS per mapping kind and the largest mappings of each process")
    parser.add_argument("extra", nargs="*", help="more `slotserve serve` flags (after --)")
    args = parser.parse_args(argv)
    port = free_port()
    c = args.concurrency
    per_seq = 128 + args.max_tokens + CTX_MARGIN
    cmd = [str(SLOTSERVE), "serve", "--model", args.model or gemma_file(), "--port", str(port),
           "--threads", "1", "--max-num-seqs", str(c), "--max-model-len", str(per_seq),
           "--num-blocks", str(c * math.ceil(per_seq / 16) + 1), "--block-size", "16",
           "--log-level", "warning", *args.extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 300.0)
        sampler = RssSampler(proc.pid)
        with ThreadPoolExecutor(c) as pool:
            usages = list(pool.map(lambda _: complete(url, args.max_tokens), range(c)))
        peak = sampler.stop()
        usage = usages[0]
        print(f"after {c} request(s) at once ({usage['prompt_tokens']} prompt + "
              f"{usage['completion_tokens']} generated tokens each):")
        total = 0
        for pid in tree(proc.pid):
            name = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[-2][:40]
            mem = rollup_mb(pid)
            total += mem["Rss"]
            print(f"  pid {pid:7d} rss {mem['Rss']:5d} MB  anonymous {mem['Anonymous']:5d} MB"
                  f"  {name}")
            if args.mappings:
                print_mappings(pid)
        print(f"  total rss {total} MB; peak while serving {peak:.0f} MB (the whole tree, "
              "sampled every 0.1 s, as vs_llamacpp.py)")
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
