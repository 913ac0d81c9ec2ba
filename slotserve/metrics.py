"""Prometheus metrics, named in the style of vLLM's with a `slotserve:` prefix.

Two sources feed them, and neither runs inside the engine step loop:
- engine-wide state (running / waiting / paused, KV usage, cumulative counters) is a snapshot of
  the engine's stats, read when `/metrics` is scraped and exposed by a custom collector, so the
  exposed counters are exactly the engine's cumulative counts;
- per-request latencies come from the timestamps the engine records on each request
  (`RequestMetrics`), turned into histogram samples on the asyncio side as outputs arrive.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "slotserve:"

# Buckets reach down to milliseconds because a CPU-served tiny model answers that fast.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# (metric suffix, help, stats attribute names tried in order)
_GAUGES = (
    ("num_requests_running", "Number of requests in the running batch.", ("num_running_reqs",)),
    ("num_requests_waiting", "Number of requests waiting to be scheduled.",
     ("num_waiting_reqs",)),
    ("num_paused_sessions", "Streaming-input sessions paused between chunks (holding KV + slot).",
     ("num_paused_sessions",)),
    ("kv_cache_usage_perc", "Fraction of usable KV cache blocks in use (0 to 1).",
     ("kv_cache_usage",)),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     ("prefix_cache_queries",)),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", ("prefix_cache_hits",)),
    ("num_preemptions", "Cumulative number of preemptions.", ("num_preemptions",)),
    ("prompt_tokens", "Prompt tokens processed (prefilled).",
     ("num_prompt_tokens", "prompt_tokens", "prompt_tokens_total")),
    ("generation_tokens", "Tokens generated.",
     ("num_generation_tokens", "generation_tokens", "generation_tokens_total")),
)
# How busy the front keeps the engine's step loop (engine_loop.LoopStats).
_LOOP_COUNTERS = (
    ("engine_loop_steps", "Steps the engine loop ran.", ("num_steps",)),
    ("engine_loop_busy_seconds", "Wall seconds the engine loop spent inside step().",
     ("busy_s",)),
    ("engine_loop_busy_cpu_seconds", "CPU seconds the engine loop thread spent inside step().",
     ("busy_cpu_s",)),
)


def stat_value(stats: Any, names: tuple[str, ...]) -> float:
    """Read a stat by its first present name; engines may hand a dataclass or a dict."""
    for name in names:
        value = stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)
        if value is not None:
            return float(value)
    return 0.0


class _EngineStatsCollector(Collector):
    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        stats = self._owner.stats
        labels = [self._owner.model_name]
        for suffix, doc, names in _GAUGES:
            g = GaugeMetricFamily(PREFIX + suffix, doc, labels=["model_name"])
            g.add_metric(labels, stat_value(stats, names) if stats is not None else 0.0)
            yield g
        for suffix, doc, names in _COUNTERS:
            c = CounterMetricFamily(PREFIX + suffix, doc, labels=["model_name"])
            c.add_metric(labels, stat_value(stats, names) if stats is not None else 0.0)
            yield c
        loop = self._owner.loop_stats
        for suffix, doc, names in _LOOP_COUNTERS:
            c = CounterMetricFamily(PREFIX + suffix, doc, labels=["model_name"])
            c.add_metric(labels, stat_value(loop, names) if loop is not None else 0.0)
            yield c


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers can share a process)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats: Any = None
        self.loop_stats: Any = None
        self._lock = threading.Lock()
        self.registry.register(_EngineStatsCollector(self))
        lab = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", lab,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", lab,
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the end of a request.", lab,
                             buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", lab,
                                    buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Requests that ended, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue = self.queue_time.labels(model_name)

    def set_stats(self, stats: Any, loop_stats: Any = None) -> None:
        self.stats = stats
        if loop_stats is not None:
            self.loop_stats = loop_stats

    def observe_itl(self, interval_s: float, num_tokens: int = 1) -> None:
        # Tokens that arrive together in one output share the interval evenly.
        if num_tokens <= 0 or not math.isfinite(interval_s) or interval_s < 0:
            return
        per_token = interval_s / num_tokens
        for _ in range(num_tokens):
            self._itl.observe(per_token)

    def observe_first_token(self, arrival_time: float | None,
                            first_token_time: float | None) -> None:
        if arrival_time is not None and first_token_time is not None:
            self._ttft.observe(max(0.0, first_token_time - arrival_time))

    def observe_finished(self, metrics: Any, finish_reason: str | None) -> None:
        """Record a request's end from the timestamps the engine stamped on it."""
        self.request_success.labels(self.model_name, finish_reason or "unknown").inc()
        if metrics is None:
            return
        arrival = getattr(metrics, "arrival_time", None)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        finished = getattr(metrics, "finished_time", None) or getattr(
            metrics, "last_token_time", None)
        if arrival is None:
            return
        if scheduled:
            self._queue.observe(max(0.0, scheduled - arrival))
        if finished:
            self._e2e.observe(max(0.0, finished - arrival))

    def render(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
