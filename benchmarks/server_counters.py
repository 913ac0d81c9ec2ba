"""What a running `slotserve serve` tree did, read from outside: the CPU seconds of each of its
processes (/proc) and its /metrics counters (the ingress merges every replica's, each sample
labelled with its `replica`), as dp_bench.py compares them between two readings.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "slotserve:"
# Summed over replicas, read before and after a run (`counted`).
COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "time_to_first_token_seconds_sum",
            "time_to_first_token_seconds_count", "request_queue_time_seconds_sum",
            "request_queue_time_seconds_count", "engine_loop_steps", "engine_loop_busy_seconds",
            "engine_loop_busy_cpu_seconds")
# Kept apart per replica (`per_replica`).
PER_REPLICA = ("generation_tokens", "engine_loop_busy_seconds", "engine_loop_busy_cpu_seconds")
_TTFT_BUCKET = "time_to_first_token_seconds_bucket"


def process_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of `root` and all its descendants (a Ray server's
    raylet, GCS, proxy, ingress, replicas and their engine cores), by pid, with a short name:
    Ray's workers name themselves (`ray::ServeReplica:...`) in their command line."""
    tick = os.sysconf("SC_CLK_TCK")
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (_short_name(cmd), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _short_name(cmd: str) -> str:
    if cmd.startswith("ray::"):
        return cmd.split()[0].replace("ray::ServeReplica:", "").replace(":dp-bench", "")
    if "core_process" in cmd or "engine" in cmd and "slotserve" in cmd and "serve" not in cmd:
        return "engine core"
    words = [w for w in cmd.split() if not w.startswith("-")]
    return " ".join(Path(w).name for w in words[:3])[:40]


def cpu_table(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
              wall: float) -> dict[str, float]:
    """CPU seconds each process spent between two readings, summed by name, printed."""
    spent: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        spent[name] = spent.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    rows = sorted(((v, k) for k, v in spent.items() if v >= 0.05), reverse=True)
    print(f"    CPU seconds per process over the {wall:.1f} s run (total "
          f"{sum(spent.values()):.1f}):", flush=True)
    for v, k in rows:
        print(f"      {v:7.2f}  {k}", flush=True)
    return spent


def _samples(url: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of the server's /metrics: (name without the prefix and a counter's
    `_total`, labels, value); counters' `_created` samples are left out."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX) and not s.name.endswith("_created"):
                yield s.name[len(PREFIX):].removesuffix("_total"), s.labels, s.value


def server_counters(url: str) -> dict[str, float]:
    """The servers' /metrics counters, summed over replicas: prefix-cache hits and queries,
    the engine-side TTFT (arrival at the replica's engine front to its first token) sum,
    count and buckets (`ttft_le_<bound>`), which split the client's TTFT into the serving
    path's and the engine's, the queue time, and the engine loops' steps and busy seconds."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for name, labels, value in _samples(url):
        key = f"ttft_le_{labels['le']}" if name == _TTFT_BUCKET else name
        if key in out or name == _TTFT_BUCKET:
            out[key] = out.get(key, 0.0) + value
    return out


def per_replica(url: str) -> dict[str, dict[str, float]]:
    """Per replica (its `replica` label; one process: "-"): tokens generated and the engine
    loop's busy wall and CPU seconds so far (each replica's report is at most a second old)."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in _samples(url):
        if name in PER_REPLICA:
            per = out.setdefault(labels.get("replica", "-"), {})
            per[name] = per.get(name, 0.0) + value
    return out


def replica_split(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                  wall: float) -> dict[str, dict[str, float]]:
    """What each replica did between two readings, printed: whether the work was split
    evenly and how much of the run each engine loop was busy."""
    split = {rid: {k: v - before.get(rid, {}).get(k, 0.0) for k, v in vals.items()}
             for rid, vals in after.items()}
    for rid, d in sorted(split.items()):
        print(f"      replica {rid[-8:]:>8}: {d.get('generation_tokens', 0):6.0f} tokens, engine "
              f"loop busy {d.get('engine_loop_busy_seconds', 0):5.1f} s of {wall:.1f} "
              f"({d.get('engine_loop_busy_cpu_seconds', 0):5.1f} CPU s)", flush=True)
    return split


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The hit rate and the engine-side TTFT mean of what was sent between two readings."""
    d = {k: after[k] - before[k] for k in after}
    return {"hit_rate": d["prefix_cache_hits"] / max(1.0, d["prefix_cache_queries"]),
            "engine_ttft_mean_ms": 1000 * d["time_to_first_token_seconds_sum"]
            / max(1.0, d["time_to_first_token_seconds_count"]),
            "engine_ttft_p50_ms": 1000 * histogram_median(d),
            "queue_mean_ms": 1000 * d["request_queue_time_seconds_sum"]
            / max(1.0, d["request_queue_time_seconds_count"]),
            "steps": d["engine_loop_steps"], "busy_s": d["engine_loop_busy_seconds"],
            "busy_cpu_s": d["engine_loop_busy_cpu_seconds"]}


def histogram_median(d: dict[str, float]) -> float:
    """The engine-side TTFT median from the histogram's bucket counts (linear within the
    bucket that holds it)."""
    cum = sorted((float(k[len("ttft_le_"):]), v) for k, v in d.items()
                 if k.startswith("ttft_le_") and k != "ttft_le_+Inf")
    half = d.get("ttft_le_+Inf", 0.0) / 2
    lo_le, lo_n = 0.0, 0.0
    for le, n in cum:
        if n >= half > 0:
            return lo_le + (le - lo_le) * (half - lo_n) / max(n - lo_n, 1e-9)
        lo_le, lo_n = le, n
    return float("nan")
