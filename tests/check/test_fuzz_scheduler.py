"""Stateful property-based fuzzing of the scheduler with the invariant checker on every step.

The events are the shared vocabulary of slotserve.check.events (the exhaustive explorer uses
the same ones): random arrivals with shared prefixes, priorities and clients (the scheduler
is fair among named clients), aborts, streaming-session chunks (empty ones included) and ends, prefix-cache resets (with and without running
requests), KV pressure that forces preemption, pipelined steps, failed model steps and steps
whose failure the worker isolated to one request, idle
sessions giving up their slot past the grace period or over the cap of idle sessions, idle
sessions timing out, and model outputs with random stops; some requests are under a grammar
(complete after a few tokens, failing on one token), which the checker holds to exactly the
tokens each request kept. Every output is applied to the
checker's reference worker and to the real RequestSlots table. The machine ends with a drain:
every session ended, every request finished, all blocks free, no slot held.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from slotserve.check.events import (
    EOS,
    STOP,
    Abort,
    Arrive,
    Chunk,
    EndSession,
    FailRequest,
    FailStep,
    Reset,
    Schedule,
    Tick,
    Update,
)
from slotserve.check.grammar import REJECTED
from slotserve.check.harness import Harness
from slotserve.spec_decode.config import SpeculativeConfig
from tests.helpers import make_scheduler

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], [31, 32, 33]]
TOKENS = [42, 43, 44, 45, STOP, EOS, REJECTED]
EXAMPLES = int(os.environ.get("SLOTSERVE_FUZZ_EXAMPLES", "300"))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        max_num_seqs=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(4, 40),
        block_size=st.sampled_from([2, 4]),
        budget=st.sampled_from([4, 8, 16, 64]),
        policy=st.sampled_from(["fcfs", "priority"]),
        chunked=st.booleans(),
        caching=st.booleans(),
        threshold=st.sampled_from([0, 0, 3]),
        max_idle=st.sampled_from([None, None, 0, 1]),
        spec_k=st.sampled_from([0, 0, 3]),
        max_loras=st.sampled_from([0, 1, 2]),
    )
    def setup(self, max_num_seqs: int, num_blocks: int, block_size: int, budget: int,
              policy: str, chunked: bool, caching: bool, threshold: int,
              max_idle: int | None, spec_k: int, max_loras: int) -> None:
        self.max_loras = max_loras
        max_model_len = 48
        if not chunked:
            budget = max(budget, max_model_len)
        self.h = Harness(make_scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
            policy=policy, enable_chunked_prefill=chunked, enable_prefix_caching=caching,
            long_prefill_token_threshold=threshold, streaming_session_timeout_s=30.0,
            idle_slot_grace_s=5.0, max_idle_sessions=max_idle, max_loras=max_loras,
            # Speculation (ngram over 1-2 token n-grams, forced on): answers accept 0..k.
            speculative_config=SpeculativeConfig(
                num_speculative_tokens=spec_k, prompt_lookup_min=1, prompt_lookup_max=2,
                adaptive=False) if spec_k else None))

    def _answer(self, data: st.DataObject) -> None:
        # One or two tokens per request whose prefill completed when it was scheduled.
        sampled = []
        out, samplers = self.h.in_flight[0]
        for rid in samplers:
            drafts = out.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                a = data.draw(st.integers(0, len(drafts)), label="drafts accepted")
                sampled.append((*drafts[:a], data.draw(st.sampled_from(TOKENS))))
                continue
            k = data.draw(st.integers(1, 2), label="tokens sampled")
            sampled.append(tuple(data.draw(st.lists(st.sampled_from(TOKENS), min_size=k,
                                                    max_size=k), label="tokens")))
        self.h.apply(Update(tuple(sampled)))

    # ------------------------------------------------------------------- rules
    @rule(prefix=st.sampled_from([None, 0, 1, 2]), tail=st.lists(st.integers(40, 60), max_size=12),
          priority=st.integers(0, 3), max_tokens=st.integers(1, 6),
          resumable=st.booleans(), min_tokens=st.integers(0, 2), ignore_eos=st.booleans(),
          grammar=st.sampled_from([0, 0, 1, 3]), lora=st.integers(0, 3),
          client=st.sampled_from([0, 0, 1, 2, 3]))
    def add_request(self, prefix: int | None, tail: list[int], priority: int, max_tokens: int,
                    resumable: bool, min_tokens: int, ignore_eos: bool, grammar: int,
                    lora: int, client: int) -> None:
        prompt = (PREFIXES[prefix] if prefix is not None else []) + tail
        self.h.apply(Arrive(tuple(prompt or [50]), max_tokens, priority, resumable,
                            min_tokens, ignore_eos, grammar, lora if self.max_loras else 0,
                            client))

    @precondition(lambda self: bool(self.h.open_sessions))
    @rule(data=st.data(), chunk=st.lists(st.integers(40, 60), max_size=6),
          end=st.sampled_from([False, False, True]), max_tokens=st.integers(1, 5))
    def session_chunk(self, data: st.DataObject, chunk: list[int], end: bool,
                      max_tokens: int) -> None:
        k = data.draw(st.integers(0, len(self.h.open_sessions) - 1), label="session")
        self.h.apply(EndSession(k) if end else Chunk(k, tuple(chunk), max_tokens))

    @precondition(lambda self: bool(self.h.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.h.apply(Abort(data.draw(st.integers(0, len(self.h.sched.requests) - 1),
                                     label="abort")))

    @rule(reset_running=st.booleans())
    def reset_prefix_cache(self, reset_running: bool) -> None:
        self.h.apply(Reset(reset_running))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.h.apply(Schedule())
        self._answer(data)

    @rule(data=st.data())
    def pipelined_steps(self, data: st.DataObject) -> None:
        # Two schedules before the first answer, as an async engine would run them.
        self.h.apply(Schedule())
        self.h.apply(Schedule())
        self._answer(data)
        self._answer(data)

    @rule()
    def failed_step(self) -> None:
        self.h.apply(Schedule())
        self.h.apply(FailStep())

    @rule(data=st.data())
    def failed_request(self, data: st.DataObject) -> None:
        # The worker isolates a failure to one request of the step; the others go on.
        self.h.apply(Schedule())
        n = len(self.h.in_flight[0][0].num_scheduled_tokens)
        if n:
            self.h.apply(FailRequest(data.draw(st.integers(0, n - 1), label="failed request")))
        else:
            self._answer(data)

    @precondition(lambda self: bool(self.h.sched.sessions.idle))
    @rule(newcomer=st.booleans())
    def idle_past_grace(self, newcomer: bool) -> None:
        # Idle sessions may now lose their slot to a waiting request (one arriving now, when
        # newcomer: the case the grace period is for, made likelier than chance makes it).
        if newcomer:
            self.h.apply(Arrive(tuple(PREFIXES[2]), 2))
        self.h.apply(Tick(self.h.sched.scheduler_config.idle_slot_grace_s + 1.0))

    @precondition(lambda self: bool(self.h.sched.sessions.idle))
    @rule()
    def idle_timeout(self) -> None:
        self.h.apply(Tick(self.h.sched.scheduler_config.streaming_session_timeout_s + 1.0))

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        self.h.drain(2000)


# The README's budget (EXAMPLES runs of 50 steps) under two explicit profiles: "ci" (CI=true)
# replays a fixed set of examples, so a red CI is reproducible, and keeps no example database
# in the clone; "dev" explores new examples every run and remembers failing ones.
_BUDGET = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("ci", _BUDGET, derandomize=True, database=None)
settings.register_profile("dev", _BUDGET)
SchedulerMachine.TestCase.settings = settings.get_profile(
    "ci" if os.environ.get("CI") == "true" else "dev")
TestSchedulerFuzz = SchedulerMachine.TestCase
