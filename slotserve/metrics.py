"""Prometheus metrics, named in the style of vLLM's with a `slotserve:` prefix.

Two sources feed them, and neither runs inside the engine step loop:
- engine-wide state (running / waiting / idle sessions, KV usage, cumulative counters) is a snapshot of
  the engine's stats, read when `/metrics` is scraped and exposed by a custom collector, so the
  exposed counters are exactly the engine's cumulative counts;
- per-request latencies come from the timestamps the engine records on each request
  (`RequestMetrics`), turned into histogram samples on the asyncio side as outputs arrive.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slotserve.engine.messages import EngineStats
from slotserve.outputs import RequestOutput

PREFIX = "slotserve:"

# Buckets reach down to milliseconds because a CPU-served tiny model answers that fast.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# (metric suffix, help, the EngineStats field it reads)
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_requests_running", "Number of requests in the running batch.", "num_running_reqs"),
    ("num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting_reqs"),
    ("num_paused_sessions", "Streaming-input sessions paused between chunks (holding KV + slot).",
     "num_paused_sessions"),
    ("kv_cache_usage_perc", "Fraction of usable KV cache blocks in use (0 to 1).",
     "kv_cache_usage"),
    ("num_slots_held", "Worker slots held (running requests, idle and promoted sessions).",
     "num_slots_held"),
    ("model_weights_bytes", "Bytes of model weights in memory (quantized blocks included).",
     "weights_bytes"),
    ("model_quantized_weights_bytes", "Bytes of weights kept in their quantized block format.",
     "quantized_weights_bytes"),
    ("kv_cache_bytes", "Bytes allocated for the KV cache (its pages become resident as blocks "
     "are first used).", "kv_cache_bytes"),
    ("engine_resident_memory_bytes", "Resident memory of the engine core's process (the "
     "serving process's own is process_resident_memory_bytes).", "resident_bytes"),
    ("grammar_cache_entries", "Compiled grammars in the engine's cache.",
     "grammar_cache_entries"),
    ("grammar_cache_bytes", "Bytes the compiled grammars in the cache are charged (what the "
     "engine grew by compiling each; bounded by the cache's byte limit).",
     "grammar_cache_bytes"),
)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("idle_session_slots_reclaimed", "Idle sessions whose slot and KV were taken (past the "
     "grace period by a waiting request, or over the cap of idle sessions).",
     "num_idle_slots_reclaimed"),
    ("failed_requests", "Requests a model step failed alone (the rest of the step went on).",
     "num_failed_requests"),
    ("prompt_tokens", "Prompt tokens processed (prefilled).", "prompt_tokens_total"),
    ("generation_tokens", "Tokens generated.", "generation_tokens_total"),
    # How busy the front keeps the engine core's step loop.
    ("engine_loop_steps", "Steps the engine loop ran.", "num_steps"),
    ("engine_loop_busy_seconds", "Wall seconds the engine loop spent inside step().", "busy_s"),
    ("engine_loop_busy_cpu_seconds", "CPU seconds the engine loop thread spent inside step().",
     "busy_cpu_s"),
    ("grammars_compiled", "Grammars compiled (cache misses; failed compiles included).",
     "num_grammars_compiled"),
    # Speculative decoding (vLLM's names; acceptance by position below).
    ("spec_decode_num_drafts", "Proposals verified (one per request and step with drafts).",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "spec_decode_num_accepted_tokens"),
)


class _EngineStatsCollector(Collector):
    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        stats, admission = self._owner.stats, self._owner.admission
        kinds = ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS))
        values: list[tuple[Callable[..., GaugeMetricFamily | CounterMetricFamily], str, str,
                           float]] = [
            (family, suffix, doc, getattr(stats, field) if stats is not None else 0.0)
            for family, table in kinds for suffix, doc, field in table]
        if admission is not None:
            values += [(GaugeMetricFamily, "num_requests_admission_waiting",
                        "Sequences accepted by the server that have not produced a token yet "
                        "(in its fair queue or in the engine).", admission.waiting.seqs),
                       (CounterMetricFamily, "requests_refused",
                        "Requests refused with 429 by admission control.", admission.num_refused)]
        for family, suffix, doc, value in values:
            metric = family(PREFIX + suffix, doc, labels=["model_name"])
            metric.add_metric([self._owner.model_name], float(value))
            yield metric
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos if stats is not None else ()
        if per_pos:
            pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the proposal.",
                                      labels=["model_name", "position"])
            for i, n in enumerate(per_pos):
                pos.add_metric([self._owner.model_name, str(i)], float(n))
            yield pos


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers can share a process)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        # The engine's stats, read when /metrics is scraped.
        self.stats: EngineStats | None = None
        # The server's admission control (entrypoints/openai/admission.py), if any.
        self.admission: Any = None
        self._lock = threading.Lock()
        self.registry.register(_EngineStatsCollector(self))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds
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

    def record_finished(self, out: RequestOutput) -> None:
        """A finished request: its end, and the latencies from the engine's timestamps."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(self.model_name, reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.first_scheduled_time:
            self._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        finished = m.finished_time or m.last_token_time
        if finished:
            self._e2e.observe(max(0.0, finished - m.arrival_time))
        if m.first_token_time is not None:
            self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        for a, b in itertools.pairwise(m.token_times):
            if b >= a:
                self._itl.observe(b - a)

    def render(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
