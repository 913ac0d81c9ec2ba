"""The routing policy on its own: block hashes agree with the KV cache's, prefix affinity,
the load term, the power-of-two fallback on imbalance, cold requests spread, reports and
evictions correct the router's view."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from slotserve.core.kv_cache_manager import KVCacheManager
from slotserve.core.request import Request
from slotserve.lora.request import LoRARequest
from slotserve.routing.policy import (
    InFlight,
    PolicyConfig,
    PrefixIndex,
    Reservations,
    RoutingPolicy,
    rank_replicas,
    request_block_hashes,
)
from slotserve.sampling_params import SamplingParams

IDS = ["a", "b", "c", "d"]


def tokens(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@pytest.mark.parametrize("salt", [None, "tenant-1"])
@pytest.mark.parametrize("lora_id", [None, 3])
def test_hashes_are_the_kv_caches_own(salt: str | None, lora_id: int | None) -> None:
    prompt = tokens(1, 70)
    lora = None if lora_id is None else LoRARequest("adapter", lora_id, "/unused")
    req = Request("r", prompt, SamplingParams(max_tokens=1), cache_salt=salt,
                  lora_request=lora)
    manager = KVCacheManager(block_size=16, num_blocks=32)
    mine = request_block_hashes(prompt, 16, salt, lora_id)
    assert mine == manager.update_block_hashes(req, 70)
    assert len(mine) == 4  # full blocks only
    assert request_block_hashes(prompt, 16, "other", lora_id) != mine
    # Another adapter (or the base) never shares a block with this one.
    assert request_block_hashes(prompt, 16, salt, 7)[0] != mine[0]
    assert (request_block_hashes(prompt, 16, salt)[0] != mine[0]) == (lora_id is not None)


def test_prefix_match_wins_over_an_idle_replica() -> None:
    index = PrefixIndex()
    hashes = request_block_hashes(tokens(2), 16)
    index.learn("c", hashes, now=0.0)
    loads = {"a": 0, "b": 0, "c": 2, "d": 0}
    assert rank_replicas(hashes, IDS, loads, index, random.Random(0))[0] == "c"
    # A longer leading match beats a shorter one; a hash past a miss does not count.
    index.learn("b", hashes[:2], now=0.0)
    index.learn("a", [hashes[0], *hashes[2:]], now=0.0)
    ranking = rank_replicas(hashes, IDS, {r: 0 for r in IDS}, index, random.Random(0))
    assert ranking[:3] == ["c", "b", "a"]


def test_load_term_moves_a_request_off_a_busy_holder() -> None:
    index = PrefixIndex(PolicyConfig(imbalanced_threshold=100, load_weight=0.1))
    hashes = request_block_hashes(tokens(3), 16)
    index.learn("a", hashes, now=0.0)
    index.learn("b", hashes[:2], now=0.0)  # half the prefix, idle
    # a: 1.0 - 0.1 * 6 = 0.4 < b: 0.5 - 0 = 0.5
    ranking = rank_replicas(hashes, ["a", "b"], {"a": 6, "b": 0}, index, random.Random(0))
    assert ranking == ["b", "a"]
    ranking = rank_replicas(hashes, ["a", "b"], {"a": 4, "b": 0}, index, random.Random(0))
    assert ranking == ["a", "b"]


def test_imbalance_falls_back_to_power_of_two_choices() -> None:
    index = PrefixIndex(PolicyConfig(imbalanced_threshold=4))
    hashes = request_block_hashes(tokens(4), 16)
    index.learn("a", hashes, now=0.0)
    loads = {"a": 9, "b": 1, "c": 2, "d": 3}
    firsts = Counter(rank_replicas(hashes, IDS, loads, index, random.Random(s))[0]
                     for s in range(200))
    # Prefix affinity is off: pow2 orders its random pair by load, so the busy holder of
    # the prefix never goes first.
    assert firsts["a"] == 0
    assert set(firsts) <= {"b", "c", "d"} and len(firsts) >= 2


def test_cold_requests_go_to_the_least_loaded_and_spread() -> None:
    index = PrefixIndex()
    index.learn("a", request_block_hashes(tokens(5), 16), now=0.0)
    cold = request_block_hashes(tokens(6), 16)
    # Equal loads: spread over every replica, the one holding cache too (no herd onto the
    # emptiest replica), none more than chance allows.
    firsts = Counter(rank_replicas(cold, IDS, {r: 0 for r in IDS}, index,
                                   random.Random(s))[0] for s in range(400))
    assert set(firsts) == set(IDS) and max(firsts.values()) < 150
    assert rank_replicas(cold, IDS, {"a": 1, "b": 0, "c": 1, "d": 1}, index,
                         random.Random(0))[0] == "b"
    # The least loaded goes first whatever it holds.
    assert rank_replicas(cold, IDS, {"a": 0, "b": 1, "c": 1, "d": 1}, index,
                         random.Random(0))[0] == "a"


def test_the_router_learns_at_once_and_reports_correct_it() -> None:
    policy = RoutingPolicy("prefix", PolicyConfig(learned_ttl_s=5.0), seed=0)
    shared = tokens(7)
    hashes = request_block_hashes(shared, 16)
    first = policy.rank(hashes, IDS, {r: 0 for r in IDS})[0]
    policy.routed(first, hashes, now=0.0)
    # Same prefix next: same replica, before any report.
    assert policy.rank(hashes, IDS, {r: 0 for r in IDS})[0] == first
    # The replica reports it holds the blocks: kept past the learned TTL.
    policy.index.report(first, hashes, now=1.0)
    policy.index.report(first, hashes, now=100.0)
    assert policy.rank(hashes, IDS, {r: 0 for r in IDS})[0] == first
    # Evicted: the next report lacks them and the learned entries have expired.
    policy.index.report(first, [], now=200.0)
    assert policy.index.summary(first).prefix_blocks(hashes) == 0
    # A learned hash not yet reported (the request is still queued) survives a report.
    policy.routed("b", hashes, now=300.0)
    policy.index.report("b", [], now=301.0)
    assert policy.index.summary("b").prefix_blocks(hashes) == len(hashes)


def test_different_prefixes_spread_and_same_prefixes_stick() -> None:
    policy = RoutingPolicy("prefix", seed=1)
    loads = {r: 0 for r in IDS}
    homes = {}
    for p in range(8):
        h = request_block_hashes(tokens(100 + p), 16)
        homes[p] = policy.rank(h, IDS, loads)[0]
        policy.routed(homes[p], h, now=0.0)
        loads[homes[p]] += 1
    assert len(set(homes.values())) == 4  # cold requests spread over all replicas
    for p in range(8):
        h = request_block_hashes(tokens(100 + p) + [1] * 16, 16)
        assert policy.rank(h, IDS, {r: 0 for r in IDS})[0] == homes[p]


def test_round_robin_and_pow2_ignore_the_prefix() -> None:
    rr = RoutingPolicy("round_robin")
    assert [rr.rank([], ["b", "a"], {})[0] for _ in range(4)] == ["a", "b", "a", "b"]
    pow2 = RoutingPolicy("pow2", seed=0)
    hashes = request_block_hashes(tokens(8), 16)
    pow2.routed("a", hashes, now=0.0)
    firsts = Counter(pow2.rank(hashes, ["a", "b"], {"a": 0, "b": 0})[0] for _ in range(100))
    assert firsts["a"] > 10 and firsts["b"] > 10
    with pytest.raises(ValueError, match="unknown router"):
        RoutingPolicy("nearest")  # type: ignore[arg-type]


def test_index_is_bounded_and_forgets_gone_replicas() -> None:
    index = PrefixIndex(PolicyConfig(max_hashes_per_replica=10))
    index.learn("a", request_block_hashes(tokens(9, 16 * 30), 16), now=0.0)
    assert index.summary("a").size == 10
    index.learn("b", [b"x"], now=0.0)
    index.retain(["b"])
    assert set(index.replicas) == {"b"}


def test_reservations_settle_on_their_replica_and_lapse() -> None:
    r = Reservations(ttl_s=2.0)
    r.reserve("a", 0.0)
    r.reserve("a", 0.5)
    r.reserve("b", 1.0)
    r.settle("b", 1.1)
    assert (r.count("a"), r.count("b"), len(r)) == (2, 0, 2)
    r.settle("c", 1.2)  # confirmed where nothing was reserved: a later choice; oldest goes
    assert (r.count("a"), len(r)) == (1, 1)
    r.expire(2.6)  # the one reserved at 0.5 was never confirmed
    assert (r.count("a"), len(r)) == (0, 0)
    r.settle("a", 3.0)  # nothing left: nothing goes negative
    assert r.count("a") == 0


def test_in_flight_counts_survive_a_completion_before_its_routing() -> None:
    # Ray Serve may call on_request_completed before on_request_routed (a fast answer beats
    # the acceptance), and completes a refused request on the replica that refused it.
    loads = {"a": 0, "b": 0}
    f = InFlight(loads, ttl_s=60.0)
    f.routed("r1", "a")
    f.completed("r2", "b", 0.0)  # answered before its routing was heard
    f.routed("r2", "b")
    assert loads == {"a": 1, "b": 0}
    f.completed("r1", "a", 1.0)
    assert loads == {"a": 0, "b": 0}
    f.completed("r3", "a", 2.0)  # refused by a, then routed to b and answered there
    f.routed("r3", "b")
    assert loads["b"] == 1
    f.completed("r3", "b", 3.0)
    assert loads == {"a": 0, "b": 0}
    f.routed("r4", "a")
    f.routed("r5", "a")
    f.clear("a")  # a reports an empty queue: whatever was open there is forgotten
    f.completed("r4", "a", 4.0)
    assert loads["a"] == 0
    f.routed("ws", "b")  # a session's messages overlap on one replica under one id
    f.routed("ws", "b")
    f.completed("ws", "b", 5.0)
    f.completed("ws", "b", 5.1)
    assert loads["b"] == 0
    f.completed("old", "a", 10.0)
    f.completed("twice", "a", 11.0)
    f.completed("twice", "a", 75.0)
    f.completed("new", "a", 80.0)  # the refused-and-never-routed ones lapse
    f.routed("old", "a")
    assert loads["a"] == 1
    f.routed("twice", "a")  # its completion at 75 s is still waiting for it
    assert loads["a"] == 1


def test_a_burst_of_cold_requests_does_not_herd() -> None:
    # 64 cold requests ranked before any is confirmed, with the confirmed loads a step
    # behind (b looked one request lighter): without reservations every one goes to b.
    confirmed = {"a": 1, "b": 0}
    herd = RoutingPolicy("prefix", seed=0)
    assert {herd.rank(request_block_hashes(tokens(i), 16), ["a", "b"], confirmed)[0]
            for i in range(64)} == {"b"}
    policy, reserved = RoutingPolicy("prefix", seed=0), Reservations()
    homes: Counter[str] = Counter()
    for i in range(64):
        loads = {rid: n + reserved.count(rid) for rid, n in confirmed.items()}
        top = policy.rank(request_block_hashes(tokens(i), 16), ["a", "b"], loads)[0]
        reserved.reserve(top, 0.0)
        homes[top] += 1
    assert homes == {"a": 32, "b": 32} or homes == {"a": 31, "b": 33}
