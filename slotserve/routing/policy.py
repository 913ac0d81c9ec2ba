"""The prefix-cache-aware routing policy: request block hashes, replica summaries and loads in,
a ranking of replicas out. Pure Python (no Ray, no torch), so the Ray Serve router
(`slotserve/ray/router.py`) and the fleet simulator (`benchmarks/fleet_sim.py`) run the same
decisions.

A request is summarised by the chain of its full blocks' hashes, computed with the KV cache's
own function (`core.kv_cache_manager.hash_block_tokens`), block size and cache salt, so a hash
the router knows for a replica is a block that replica's prefix cache can hit. Ranking, as
Ray's `PrefixCacheAffinityRouter` and SGLang's router do it: while the queue-length gap between
replicas exceeds a threshold, power of two choices (load first); otherwise the replicas holding
the most leading blocks of the request, minus a load term; a request that matches nothing goes
to the least loaded, ties at random, so cold requests spread.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from slotserve.core.kv_cache_manager import NONE_HASH, block_extra, hash_block_tokens

RouterPolicy = Literal["prefix", "pow2", "round_robin"]
ROUTER_POLICIES: tuple[RouterPolicy, ...] = ("prefix", "pow2", "round_robin")


def request_block_hashes(token_ids: Sequence[int], block_size: int,
                         cache_salt: str | None = None,
                         lora_int_id: int | None = None) -> list[bytes]:
    """The hashes of the full blocks of `token_ids`, chained exactly as
    `KVCacheManager.update_block_hashes` chains them (the salt and the adapter's id enter the
    first block, so prefixes under different adapters never match)."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    first = block_extra(cache_salt, lora_int_id)
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, list(token_ids[i * block_size:(i + 1) * block_size]),
                                   first if i == 0 else None)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    # Past this gap between the longest and the shortest queue, prefix affinity is dropped
    # for power of two choices (Ray's PrefixCacheAffinityRouter defaults to 10).
    imbalanced_threshold: int = 8
    # A full prefix match is worth this many queued requests.
    load_weight: float = 0.1
    # Hashes remembered per replica (the router's approximate view of its cache).
    max_hashes_per_replica: int = 65536
    # How long a hash the router learnt from its own decision outlives the replica's reports
    # without appearing in them (the request may still be waiting to be prefilled).
    learned_ttl_s: float = 5.0


@dataclass(slots=True)
class ReplicaSummary:
    """The router's view of one replica's prefix cache: hashes the replica reported (exact
    as of its last report) and hashes learnt from routing decisions since, with their time."""

    replica_id: str
    reported: frozenset[bytes] = frozenset()
    learned: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.reported or block_hash in self.learned

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n

    @property
    def size(self) -> int:
        return len(self.reported) + len(self.learned)


class PrefixIndex:
    """Per-replica summaries, updated by the router's own decisions (at once) and corrected
    by what replicas report (their cached hashes: evictions disappear from the next report)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.replicas: dict[str, ReplicaSummary] = {}

    def summary(self, replica_id: str) -> ReplicaSummary:
        s = self.replicas.get(replica_id)
        if s is None:
            s = self.replicas[replica_id] = ReplicaSummary(replica_id)
        return s

    def learn(self, replica_id: str, hashes: Iterable[bytes], now: float) -> None:
        learned = self.summary(replica_id).learned
        for h in hashes:
            learned[h] = now
            learned.move_to_end(h)
        while len(learned) > self.config.max_hashes_per_replica:
            learned.popitem(last=False)

    def report(self, replica_id: str, hashes: Iterable[bytes], now: float) -> None:
        s = self.summary(replica_id)
        s.reported = frozenset(hashes)
        cutoff = now - self.config.learned_ttl_s
        for h in [h for h, t in s.learned.items() if t < cutoff or h in s.reported]:
            del s.learned[h]

    def clear(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a dead replica's cache is gone with it)."""
        keep = set(replica_ids)
        for rid in [r for r in self.replicas if r not in keep]:
            del self.replicas[rid]


class Reservations:
    """Decisions made but not yet counted in a replica's load. Ray Serve counts a request
    on a replica (`on_request_routed`) only once the replica has answered that it accepts it,
    a round trip later; meanwhile its other routing tasks choose with the old loads, so a
    burst of cold requests herds onto whichever replica looked least loaded (measured here:
    64 requests sent at once left 3,031 output tokens on one replica, 1,142 on the other).
    A decision reserves its replica at once; the replica's next confirmation settles the
    oldest reservation on it (or, when none is left there, the oldest anywhere: the request
    went to a later choice); one never confirmed (refused, cancelled) lapses after `ttl_s`."""

    def __init__(self, ttl_s: float = 2.0) -> None:
        self.ttl_s = ttl_s
        self._queue: deque[tuple[float, str]] = deque()
        self._count: Counter[str] = Counter()

    def reserve(self, replica_id: str, now: float) -> None:
        self._queue.append((now, replica_id))
        self._count[replica_id] += 1

    def settle(self, replica_id: str, now: float) -> None:
        self.expire(now)
        for i, (_, rid) in enumerate(self._queue):
            if rid == replica_id:
                del self._queue[i]
                self._count[rid] -= 1
                return
        if self._queue:
            _, rid = self._queue.popleft()
            self._count[rid] -= 1

    def expire(self, now: float) -> None:
        while self._queue and now - self._queue[0][0] > self.ttl_s:
            _, rid = self._queue.popleft()
            self._count[rid] -= 1

    def count(self, replica_id: str) -> int:
        return self._count[replica_id]

    def __len__(self) -> int:
        return len(self._queue)


class InFlight:
    """The requests a router has on each replica (its load term). Ray Serve registers a
    request's completion callback before it waits for the replica's acceptance, so a request
    answered within that wait completes (`on_request_completed`) before it is routed
    (`on_request_routed`); a bare counter then went 0 -> 0 -> 1 and kept the replica looking
    busy for good, so every cold request went to the other one. So calls are matched by
    (request id, replica): one HTTP request's calls share its id (a WebSocket session's
    messages overlap on one replica; a refused call completes on the replica that refused it
    and is routed to another), and a completion not routed yet waits for its routing, or
    lapses after `ttl_s`."""

    def __init__(self, loads: dict[str, int], ttl_s: float = 60.0) -> None:
        self.loads = loads  # replica id -> calls in flight; updated in place
        self.ttl_s = ttl_s
        self._open: Counter[tuple[str, str]] = Counter()
        # Early completions in the order they came (as Reservations keeps its queue), those
        # still waiting for their routing per call, and those a routing already took that
        # are still in the queue (a key's entries lapse oldest first, as routings take them).
        self._early: deque[tuple[float, tuple[str, str]]] = deque()
        self._waiting: Counter[tuple[str, str]] = Counter()
        self._taken: Counter[tuple[str, str]] = Counter()

    def routed(self, request_id: str, replica_id: str) -> None:
        key = (request_id, replica_id)
        if self._waiting[key] > 0:
            _decrement(self._waiting, key)
            self._taken[key] += 1
            return
        self._open[key] += 1
        self.loads[replica_id] = self.loads.get(replica_id, 0) + 1

    def completed(self, request_id: str, replica_id: str, now: float) -> None:
        key = (request_id, replica_id)
        if self._open[key] > 0:
            _decrement(self._open, key)
            self.loads[replica_id] = max(0, self.loads.get(replica_id, 0) - 1)
            return
        self._early.append((now, key))
        self._waiting[key] += 1
        while now - self._early[0][0] > self.ttl_s:
            _, old = self._early.popleft()
            _decrement(self._taken if self._taken[old] > 0 else self._waiting, old)

    def clear(self, replica_id: str, gone: bool = False) -> None:
        """Forget every call on a replica: it holds none of them (its count is 0), or it is
        `gone` (its count goes too)."""
        for key in [k for k in self._open if k[1] == replica_id]:
            del self._open[key]
        if gone:
            self.loads.pop(replica_id, None)
        else:
            self.loads[replica_id] = 0


def _decrement(counter: Counter[tuple[str, str]], key: tuple[str, str]) -> None:
    """One less of `key` (dropped at 0, so that counters of finished calls do not grow)."""
    counter[key] -= 1
    if not counter[key]:
        del counter[key]


def _pow2(replica_ids: Sequence[str], loads: Mapping[str, int],
          rng: random.Random) -> list[str]:
    picked = rng.sample(list(replica_ids), min(2, len(replica_ids)))
    picked.sort(key=lambda r: loads.get(r, 0))
    rest = sorted((r for r in replica_ids if r not in picked), key=lambda r: loads.get(r, 0))
    return picked + rest


def rank_replicas(hashes: Sequence[bytes], replica_ids: Sequence[str],
                  loads: Mapping[str, int], index: PrefixIndex,
                  rng: random.Random) -> list[str]:
    """The prefix policy: replica ids, most preferred first. `loads` are queue lengths."""
    if not replica_ids:
        return []
    queue = [loads.get(r, 0) for r in replica_ids]
    if max(queue) - min(queue) > index.config.imbalanced_threshold or not hashes:
        return _pow2(replica_ids, loads, rng)
    match = {r: index.summary(r).prefix_blocks(hashes) for r in replica_ids}
    tiebreak = {r: rng.random() for r in replica_ids}
    if max(match.values()) == 0:
        # Cold: the least loaded, ties at random. (Not "the one holding the least cache":
        # a fresh replica would then take every cold request until its cache outgrew the
        # others', a herd the fleet simulator shows.)
        return sorted(replica_ids, key=lambda r: (loads.get(r, 0), tiebreak[r]))
    w = index.config.load_weight
    return sorted(replica_ids, key=lambda r: (
        -(match[r] / len(hashes) - w * loads.get(r, 0)), loads.get(r, 0), tiebreak[r]))


class RoutingPolicy:
    """One router's state: the policy, its prefix index, its random source and the
    round-robin turn. `routed` learns from a decision at once (the request will be cached
    where it went before any report says so)."""

    def __init__(self, policy: RouterPolicy = "prefix", config: PolicyConfig | None = None,
                 seed: int | None = None) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router {policy!r}; known: {', '.join(ROUTER_POLICIES)}")
        self.policy = policy
        self.index = PrefixIndex(config)
        self.rng = random.Random(seed)
        self._turn = 0

    def rank(self, hashes: Sequence[bytes], replica_ids: Sequence[str],
             loads: Mapping[str, int]) -> list[str]:
        if not replica_ids:
            return []
        if self.policy == "round_robin":
            ordered = sorted(replica_ids)
            k = self._turn % len(ordered)
            self._turn += 1
            return ordered[k:] + ordered[:k]
        if self.policy == "pow2":
            return _pow2(replica_ids, loads, self.rng)
        return rank_replicas(hashes, replica_ids, loads, self.index, self.rng)

    def routed(self, replica_id: str, hashes: Sequence[bytes], now: float) -> None:
        if self.policy == "prefix":
            self.index.learn(replica_id, hashes, now)
