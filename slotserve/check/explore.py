"""Exhaustive exploration of the scheduler's event interleavings for small configurations.

    python -m slotserve.check.explore --max-num-seqs 2 --num-blocks 4 --block-size 2 \\
        --depth 8 [--policy priority] [--sessions] [--failures]

Breadth-first search from an empty engine over every event of the shared vocabulary
(slotserve.check.events) that the menu allows: arrivals, session chunks and ends, aborts,
prefix-cache resets with and without running requests, schedule() with up to two outputs in
flight, the model's answers (a token or a stop per sampling request; a failed step), and
jumps of the session clock. Every output goes through the invariant checker and the real
worker slot table; states equal up to renaming (slotserve.check.canonical) are expanded once.

Liveness: from every distinct state, draining (end every session, no more arrivals, the model
answers every output with a token) must finish every request and free every block and slot
within --drain-steps steps; a state that does not is a wedge, reported like a violation.

Breadth-first order makes the first violation found a shortest one. It is printed as an event
list and written as a trace that `python -m slotserve.check.trace` replays.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields

from slotserve.check.canonical import canonical_key
from slotserve.check.events import Event, Menu, enabled_events
from slotserve.check.harness import Harness, Wedge
from slotserve.check.trace import TraceRecorder
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.scheduler import Scheduler
from slotserve.spec_decode.config import SpeculativeConfig

# The states of interest the CI exploration must reach (Harness effects).
REQUIRED_EFFECTS = ("preemption", "prefix hit", "idle session holds a slot",
                    "reset with running requests", "idle session's slot taken")


@dataclass(frozen=True, slots=True)
class ExploreConfig:
    max_num_seqs: int = 2
    num_blocks: int = 4
    block_size: int = 2
    max_num_batched_tokens: int = 6
    max_model_len: int = 16
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    session_timeout_s: float = 10.0
    idle_slot_grace_s: float = 2.0
    max_idle_sessions: int | None = None
    max_loras: int = 0  # adapter slots (Menu.loras names the adapters requests use)
    depth: int = 8
    drain_steps: int = 40
    menu: Menu = field(default_factory=Menu)
    # > 0: speculative decoding (ngram, n-grams of 1-2 tokens, forced on) with this k.
    num_speculative_tokens: int = 0

    def scheduler(self) -> Scheduler:
        spec = (SpeculativeConfig(method="ngram",
                                  num_speculative_tokens=self.num_speculative_tokens,
                                  prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False)
                if self.num_speculative_tokens else None)
        return Scheduler(
            SchedulerConfig(max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len,
                            policy=self.policy,  # type: ignore[arg-type]
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            enable_chunked_prefill=self.enable_chunked_prefill,
                            streaming_session_timeout_s=self.session_timeout_s,
                            idle_slot_grace_s=self.idle_slot_grace_s,
                            max_idle_sessions=self.max_idle_sessions,
                            speculative_config=spec, max_loras=self.max_loras),
            CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                        enable_prefix_caching=self.enable_prefix_caching))


@dataclass(slots=True)
class Violation:
    kind: str  # "violation" (a check failed on an event) or "wedge" (a state cannot drain)
    events: list[Event]
    error: str
    # False when the sequence was found by a drain longer than the explored depth, so a
    # shorter one may exist beyond the depth explored.
    shortest: bool = True
    trace_path: str | None = None


@dataclass(slots=True)
class Report:
    states: int = 0  # transitions taken (successor states generated)
    distinct: int = 1  # distinct canonical states, the empty engine included
    deepest: int = 0  # the deepest level at which a new distinct state appeared
    seconds: float = 0.0
    drained: int = 0  # distinct states checked for liveness
    merges_checked: int = 0  # merged states whose successors were compared (check_merges)
    effects: Counter[str] = field(default_factory=Counter)
    violation: Violation | None = None
    complete: bool = False  # True when no new state appeared at the last level

    def summary(self) -> str:
        lines = [f"explored {self.states} states ({self.distinct} distinct) in "
                 f"{self.seconds:.1f} s; deepest new state at depth {self.deepest}"
                 + (" (closed: nothing new at the last level)" if self.complete else "")]
        lines.append(f"liveness: {self.drained} distinct states drained")
        if self.merges_checked:
            lines.append(f"merges checked: {self.merges_checked} (same successors)")
        lines.append("states of interest: " + ", ".join(
            f"{k} {v}" for k, v in sorted(self.effects.items())))
        v = self.violation
        if v is None:
            lines.append("no violation, no wedge")
        else:
            note = "" if v.shortest else " (found by a drain past the explored depth)"
            lines.append(f"{v.kind.upper()} after {len(v.events)} events{note}: {v.error}")
            lines.extend(_numbered(v.events))
            if v.trace_path:
                lines.append(f"trace: {v.trace_path}  (replay: python -m slotserve.check.trace "
                             f"{v.trace_path})")
        return "\n".join(lines)


def explore(cfg: ExploreConfig, trace_path: str | None = None,
            check_merges: bool = False) -> Report:
    return _Search(cfg, check_merges).run(trace_path)


class _Search:
    """Breadth-first search; node i of the search tree is (parent node, event)."""

    def __init__(self, cfg: ExploreConfig, check_merges: bool) -> None:
        self.cfg = cfg
        self.check_merges = check_merges
        self.report = Report()
        self.nodes: list[tuple[int, Event | None]] = [(-1, None)]
        self.seen: set[bytes] = set()
        # check_merges: the snapshot of the state each key was first reached by.
        self.representative: dict[bytes, bytes] = {}
        self.drain_memo: dict[bytes, int] = {}
        # A violation that a drain hit: the search goes on (without drains) to the depth
        # where a shorter one could still be, since drains are not breadth-first.
        self.candidate: Violation | None = None

    def path(self, node: int) -> list[Event]:
        out = []
        while node > 0:
            node, ev = self.nodes[node]
            assert ev is not None
            out.append(ev)
        return out[::-1]

    def run(self, trace_path: str | None) -> Report:
        start = time.perf_counter()
        report, cfg = self.report, self.cfg
        root = Harness(cfg.scheduler())
        key = canonical_key(root)
        self.seen.add(key)
        if self.check_merges:
            self.representative[key] = pickle.dumps(root)
        frontier = [(0, pickle.dumps(root), enabled_events(root, cfg.menu))]
        depth = 0
        while frontier and report.violation is None:
            depth += 1
            limit = cfg.depth
            if self.candidate is not None:
                limit = min(limit, len(self.candidate.events) - 1)
            if depth > limit:
                break
            frontier = self.expand(frontier, depth, depth < limit)
            report.distinct = len(self.seen)
            if report.violation is None and report.deepest < depth:
                report.complete = True
                break
        if report.violation is None and self.candidate is not None:
            report.violation = self.candidate
        if report.violation is not None and trace_path is not None:
            write_trace(cfg, report.violation.events, trace_path)
            report.violation.trace_path = trace_path
        report.seconds = time.perf_counter() - start
        return report

    def expand(self, frontier: list[tuple[int, bytes, list[Event]]], depth: int,
               keep: bool) -> list[tuple[int, bytes, list[Event]]]:
        report, menu = self.report, self.cfg.menu
        seen = self.seen
        next_frontier = []
        for node, snap, events in frontier:
            for ev in events:
                h = pickle.loads(snap)
                report.states += 1
                try:
                    h.apply(ev)
                except Exception as exc:  # noqa: BLE001 - any failure is a finding
                    # Breadth-first: no shorter sequence breaks a check.
                    report.violation = Violation("violation", self.path(node) + [ev],
                                                 _describe(exc))
                    return []
                report.effects.update(h.effects)
                key = canonical_key(h)
                if key in seen:
                    if self.check_merges:
                        self.compare_merged(key, h, self.path(node) + [ev])
                    continue
                seen.add(key)
                self.nodes.append((node, ev))
                child = len(self.nodes) - 1
                report.deepest = depth
                if keep or self.check_merges:
                    child_snap = pickle.dumps(h)
                    if keep:
                        next_frontier.append((child, child_snap, enabled_events(h, menu)))
                    if self.check_merges:
                        self.representative[key] = child_snap
                if self.candidate is None:
                    self.check_drains(h, key, child)
                    if report.violation is not None:
                        return []
        return next_frontier

    def check_drains(self, h: Harness, key: bytes, node: int) -> None:
        """Drain h, which is consumed (its snapshot is taken). States met on the way are
        remembered with the steps they still needed: the drain is deterministic, so a later
        drain that meets one of them (up to renaming) stops there."""
        memo = self.drain_memo
        visited: list[bytes] = []
        # When the drain's first phase (ending sessions, answering outputs) has nothing to
        # do, its first state is h itself, whose key is known.
        first = [key] if not h.open_sessions and not h.in_flight else []

        def known(state: Harness) -> int | None:
            k = first.pop() if first else canonical_key(state)
            rest = memo.get(k)
            if rest is None:
                visited.append(k)
            return rest

        log: list[Event] = []
        try:
            total = h.drain(self.cfg.drain_steps, known, log)
        except Wedge as exc:
            # A property of this state, reached breadth-first: the shortest such state. The
            # drain is redone without the memo so that its events show the whole of it.
            events = self.path(node)
            self.report.violation = Violation("wedge", events + self.full_drain(events),
                                              _describe(exc))
            return
        except Exception as exc:  # noqa: BLE001
            events = self.path(node) + log
            self.candidate = Violation("violation", events, _describe(exc),
                                       shortest=len(events) - 1 <= self.cfg.depth)
            return
        self.report.drained += 1
        for i, k in enumerate(visited):
            memo[k] = total - i

    def full_drain(self, events: list[Event]) -> list[Event]:
        h = Harness(self.cfg.scheduler())
        for ev in events:
            h.apply(ev)
        log: list[Event] = []
        with contextlib.suppress(Exception):
            h.drain(self.cfg.drain_steps, log=log)
        return log

    def compare_merged(self, key: bytes, h: Harness, events: list[Event]) -> None:
        """A state merged into an earlier one must have the same successors (checked one
        event ahead, by key, effects and failures)."""
        self.report.merges_checked += 1
        rep = pickle.loads(self.representative[key])
        mine, theirs = _successors(h, self.cfg.menu), _successors(rep, self.cfg.menu)
        if mine != theirs:
            diff = next((a, b) for a, b in zip(mine + [None], theirs + [None], strict=False)
                        if a != b)
            raise AssertionError(f"unsound merge: the state after {[str(e) for e in events]} "
                                 f"was merged but its successors differ: {diff}")


def _successors(h: Harness, menu: Menu) -> list[tuple[str, str, tuple[str, ...]]]:
    snap = pickle.dumps(h)
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for ev in enabled_events(h, menu):
        s = pickle.loads(snap)
        try:
            s.apply(ev)
        except Exception as exc:  # noqa: BLE001
            out.append((str(ev), type(exc).__name__, ()))
            continue
        out.append((str(ev), canonical_key(s).hex(), tuple(sorted(s.effects))))
    return out


def _numbered(events: list[Event]) -> list[str]:
    """One line per event; a drain's repeated (schedule, answer) pairs fold into one line."""
    text = [str(e) for e in events]
    lines, i = [], 0
    while i < len(text):
        j = i + 2
        while j + 1 < len(text) and text[j:j + 2] == text[i:i + 2]:
            j += 2
        if j - i > 4:
            lines.append(f"  {i + 1:3d}-{j}. ({text[i]}; {text[i + 1]}) x {(j - i) // 2}")
            i = j
        else:
            lines.append(f"  {i + 1:3d}. {text[i]}")
            i += 1
    return lines


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def write_trace(cfg: ExploreConfig, events: list[Event], path: str) -> None:
    """Replay events from an empty engine with a recorder attached; the trace ends with the
    event that failed (a wedge's events include the drain that did not finish)."""
    sched = cfg.scheduler()
    recorder = TraceRecorder(path, sched.scheduler_config, sched.cache_config)
    h = Harness(sched, recorder)
    try:
        for ev in events:
            h.apply(ev)
    except Exception:  # noqa: BLE001, S110 - the failure is what the trace records
        pass
    finally:
        recorder.close()


def _tuple_list(text: str) -> tuple[tuple[int, ...], ...]:
    # "131,133" -> ((1, 3, 1), (1, 3, 3)); "-" is the empty chunk.
    return tuple(() if p == "-" else tuple(int(c) for c in p) for p in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: list[str] | None) -> tuple[ExploreConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m slotserve.check.explore",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=4, help="block 0 is the null block")
    p.add_argument("--block-size", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=6)
    p.add_argument("--max-model-len", type=int, default=16)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="needs --max-num-batched-tokens >= --max-model-len")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--depth", type=int, default=8, help="events from the empty engine "
                   "(a schedule() and the model's answer to it are two events)")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--sessions", action="store_true", help="streaming sessions: chunks, ends, "
                   "and jumps of the clock past the idle-slot grace period and the idle timeout")
    p.add_argument("--idle-slot-grace", type=float, default=2.0, dest="idle_slot_grace_s",
                   help="seconds an idle session keeps a slot that a waiting request needs")
    p.add_argument("--max-idle-sessions", type=int, default=None,
                   help="idle sessions that may keep slot and KV (default: no cap)")
    p.add_argument("--failures", action="store_true", help="model steps may fail")
    p.add_argument("--request-failures", action="store_true",
                   help="a step may fail for one of its requests only (the worker isolates it)")
    p.add_argument("--no-resets", action="store_true", help="no reset_prefix_cache events")
    p.add_argument("--no-aborts", action="store_true", help="no abort events")
    p.add_argument("--prompts", default="1313", help="prompts, one digit per token "
                   "(repeated prefixes give prefix hits)")
    p.add_argument("--chunks", default="3", help="session chunks ('-' is an empty chunk)")
    p.add_argument("--max-tokens", default="2")
    p.add_argument("--priorities", default=None,
                   help="default: 0 for fcfs, 0,1 for priority")
    p.add_argument("--max-live-requests", type=int, default=3,
                   help="no arrival while this many requests are unfinished")
    p.add_argument("--max-in-flight", type=int, default=2,
                   help="scheduled outputs the model has not answered yet (pipelining)")
    p.add_argument("--drain-steps", type=int, default=40,
                   help="the liveness bound: steps a drain may take")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding (ngram) with this many drafts; the model "
                   "accepts 0..k of them")
    p.add_argument("--check-merges", action="store_true",
                   help="compare every merged state's successors with its representative's "
                   "(slow; checks the canonical hashing)")
    p.add_argument("--trace-out", default="explore-violation.jsonl",
                   help="where the shortest violating sequence is written as a trace")
    a = p.parse_args(argv)
    priorities = a.priorities or ("0,1" if a.policy == "priority" else "0")
    menu = Menu(prompts=_tuple_list(a.prompts), chunks=_tuple_list(a.chunks),
                max_tokens=_ints(a.max_tokens), priorities=_ints(priorities),
                sessions=a.sessions, ticks=a.sessions, failures=a.failures,
                request_failures=a.request_failures,
                resets=not a.no_resets, aborts=not a.no_aborts,
                max_live_requests=a.max_live_requests, max_in_flight=a.max_in_flight)
    # The flags named as ExploreConfig's fields set them; the rest are built above.
    given = {f.name: getattr(a, f.name) for f in fields(ExploreConfig) if hasattr(a, f.name)}
    cfg = ExploreConfig(**given, enable_chunked_prefill=not a.no_chunked_prefill,
                        enable_prefix_caching=not a.no_prefix_caching, menu=menu)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    print(f"exploring {cfg.policy}, {cfg.max_num_seqs} slots, {cfg.num_blocks} blocks of "
          f"{cfg.block_size}, budget {cfg.max_num_batched_tokens}, depth {cfg.depth}: "
          f"{cfg.menu}", flush=True)
    report = explore(cfg, args.trace_out, args.check_merges)
    print(report.summary())
    return 0 if report.violation is None else 1


if __name__ == "__main__":
    sys.exit(main())
