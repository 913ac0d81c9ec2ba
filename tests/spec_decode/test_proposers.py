"""The proposers and the on-only-where-it-pays rule, pure Python."""

from __future__ import annotations

import random

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import ModelRunnerOutput
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.sampling_params import SamplingParams
from slotserve.spec_decode.config import SpeculativeConfig
from slotserve.spec_decode.policy import (
    StepCostTable,
    choose_num_drafts,
    prior_cost,
    update_alpha,
)
from slotserve.spec_decode.proposers import GlobalSuffixCache, NgramProposer, SuffixProposer
from slotserve.spec_decode.scheduling import SpecDecodeScheduler


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer(2, 3)
    assert p.propose([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]
    # The latest occurrence wins, and the longest n-gram before a shorter one.
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3], 3) == [5, 7, 2]
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 4], 3) == [9, 2, 3]
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert NgramProposer(3, 3).propose([5, 2, 3, 6, 2, 3], 3) == []  # only a 2-gram matches


def test_ngram_incremental_equals_fresh() -> None:
    rng = random.Random(0)
    tokens: list[int] = []
    inc = NgramProposer(1, 3)
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert inc.propose(tokens, 4) == NgramProposer(1, 3).propose(tokens, 4)
    # A sequence that shrank (a session dropped its last token) is indexed again.
    assert inc.propose(tokens[:50], 4) == NgramProposer(1, 3).propose(tokens[:50], 4)


def test_suffix_own_tokens_and_global_cache() -> None:
    own = SuffixProposer(None, max_depth=24, spec_factor=1.0)
    assert own.propose([7, 8, 9, 10, 11, 7, 8, 9], 5) == [10, 11, 7]  # 3 matched: <= 3
    cache = GlobalSuffixCache(max_requests=2)
    cache.add([40, 41, 42, 43, 44, 45])
    p = SuffixProposer(cache, max_depth=24, spec_factor=2.0)
    assert p.propose([1, 2, 40, 41], 8) == [42, 43, 44, 45]  # stops at the output's end
    assert SuffixProposer(cache, 24, 1.0).propose([3, 41, 42], 8) == [43, 44]
    # Past the bound the cache keeps the newest half and cursors match again.
    cache.add([50, 51, 52])
    cache.add([60, 61, 62, 63])
    assert len(cache.outputs) == 1 and cache.generation == 1
    assert p.propose([1, 2, 40, 41, 60, 61], 8) == [62, 63]


def test_finished_outputs_feed_the_suffix_cache() -> None:
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64, speculative_config=spec),
                      CacheConfig(block_size=4, num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(rid: str, outputs: list[int]) -> list[list[int]]:
        sched.add_request(Request(rid, [100 + len(rid), 5, 6], params))
        drafts, it = [], iter(outputs)
        while sched.has_unfinished_requests():
            so = sched.schedule()
            d = so.scheduled_spec_decode_tokens.get(rid, [])
            drafts.append(d)
            # The model emits the next outputs, accepting drafts that match them.
            gen = [next(it)]
            for t in d:
                if t != gen[-1]:
                    break
                gen.append(next(it, 0))
            sched.update_from_output(so, ModelRunnerOutput([rid], {rid: 0}, [gen]))
        return drafts

    assert not any(run("a", [20, 21, 22, 23, 24, 25, 0, 0, 0]))
    # The second request's output starts like the first's: the cache proposes the rest of
    # a's output, more of it the longer the match (spec_factor 1: a draft per matched token).
    assert run("bb", [20, 21, 22, 23, 24, 25, 0, 0, 0]) == [[], [21], [23, 24]]
    stats = sched.make_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens)


def test_cost_table_measures_each_size_over_the_scaled_prior() -> None:
    cost = StepCostTable()
    assert cost.estimate(8) == prior_cost(8)  # nothing measured: the prior's units
    cost.observe(32, 0.2)
    # One measured size sets the scale of every other through the prior's shape.
    assert abs(cost.estimate(64) / cost.estimate(32) - prior_cost(64) / prior_cost(32)) < 1e-9
    # A size measured once stays near the scaled prior; as its steps agree, they win.
    slow = 3 * cost.estimate(64)
    cost.observe(64, slow)
    once = cost.estimate(64)
    for _ in range(40):
        cost.observe(64, slow)
    assert once < 0.6 * slow and cost.estimate(64) > 0.75 * slow
    assert cost.estimate(48) > prior_cost(48) / prior_cost(32) * 0.2  # the scale moved up


def test_rule_speculates_at_one_sequence_and_turns_off_at_high_batch() -> None:
    cost = StepCostTable()
    for t in list(range(1, 300)) * 20:  # a step: 10 ms + 0.5 ms per token
        cost.observe(t, 0.010 + 0.0005 * t)
    assert choose_num_drafts(0.8, 4, 1.0, 1, cost)[0] == 4
    assert choose_num_drafts(0.1, 4, 1.0, 1, cost)[0] <= 1
    assert choose_num_drafts(0.8, 4, 256.0, 256, cost) == (0, 0.0)
    assert choose_num_drafts(0.0, 4, 1.0, 1, cost) == (0, 0.0)
    # A gain under the margin is no gain: every verified token as dear as a step's share.
    flat = StepCostTable()
    for t in list(range(1, 40)) * 20:
        flat.observe(t, 0.001 * t)
    assert choose_num_drafts(0.99, 7, 8.0, 8, flat) == (0, 0.0)
    # In scheduler order: the same request pays at an empty step and not after seven
    # others' drafts made the step dear.
    assert choose_num_drafts(0.9, 4, 8.0, 8, cost)[0] > 0
    assert choose_num_drafts(0.9, 4, 8.0 + 7 * 3.44, 8 + 7 * 4, cost) == (0, 0.0)
    # The gain must hold by the prior too: a table that measured verify tokens free
    # (a quiet moment) does not turn speculation on at a batch where the prior says no.
    quiet = StepCostTable()
    for t in list(range(1, 64)) * 20:
        quiet.observe(t, 0.01)
    assert choose_num_drafts(0.9, 4, 32.0, 32, quiet) == (0, 0.0)
    assert choose_num_drafts(0.9, 4, 32.0, 32, quiet) != choose_num_drafts(0.9, 4, 1.0, 1, quiet)
    assert update_alpha(0.6, 0, 1) < 0.6 < update_alpha(0.6, 3, 3)


def test_requests_decide_in_scheduler_order_against_the_planned_step() -> None:
    spec = SpecDecodeScheduler(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    for t in list(range(1, 64)) * 20:  # a step: 10 ms + 0.2 ms per token
        spec.cost.observe(t, 0.010 + 0.0002 * t)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    reqs = []
    for i in range(4):
        r = Request(f"r{i}", [7, 8, 9, 10, 7, 8, 9], params)  # proposes 10, 7, 8, 9
        r.num_computed_tokens = r.num_tokens - 1
        reqs.append(r)

    def step() -> list[int]:
        n = [len(spec.propose(r, 64, 256, len(reqs))) for r in reqs]
        spec.take_scheduled({r.request_id: 1 + k for r, k in zip(reqs, n, strict=True)}, 0.0)
        return n

    first = step()
    # The first requests take drafts while they pay; the step's cost then stops the rest.
    assert first[0] > 0 and first[-1] == 0 and first == sorted(first, reverse=True)
    # Each step is planned afresh, and a request given back its drafts gives back its share.
    assert step() == first
    assert spec.propose(reqs[0], 64, 256, len(reqs)) and spec.unpropose("r0")
    assert spec._plan_tokens == len(reqs) and abs(spec._plan_expected - len(reqs)) < 1e-9
