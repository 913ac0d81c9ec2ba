"""The scheduler's side of speculative decoding, composed by core/scheduler.py through a few
hooks: drafts for a decoding request (counted against the token budget and max_model_len,
their KV slots allocated with the step), the rollback after verification, and the
bookkeeping of what was proposed and accepted.

The drafts never enter a request's token list: only accepted tokens are appended (by the
ordinary update path), so the prefix cache, which hashes blocks of `all_token_ids` up to
`num_tokens`, can never hash a block over an unaccepted token. What rolls back is the
optimistic computed cursor: a step of 1 + k tokens advanced it by 1 + k, and after `a`
drafts are accepted it stands at the accepted tokens' end, num_tokens - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotserve.core.outputs import SchedulerOutput
from slotserve.core.request import Request
from slotserve.spec_decode.config import SpeculativeConfig
from slotserve.spec_decode.policy import (
    ALPHA_PRIOR,
    StepCostTable,
    choose_num_drafts,
    update_alpha,
)
from slotserve.spec_decode.proposers import GlobalSuffixCache, NgramProposer, SuffixProposer

Proposer = NgramProposer | SuffixProposer


@dataclass(slots=True)
class _RequestState:
    proposer: Proposer
    alpha: float = ALPHA_PRIOR
    # The first token of a proposal that was not verified (speculation off for it this
    # step): compared with the token the step produces, it keeps alpha measured.
    shadow: int | None = None


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecodeScheduler:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.states: dict[str, _RequestState] = {}
        self.cache = (GlobalSuffixCache(config.suffix_decoding_max_cached_requests)
                      if config.method == "suffix" else None)
        # This step's drafts by request, handed to the worker in SchedulerOutput.
        self.scheduled: dict[str, list[int]] = {}
        self.cost = StepCostTable()
        # The step as planned so far, in scheduler order: tokens scheduled and tokens
        # expected (None: no request asked yet this step); E(k) of each request's drafts.
        self._plan_tokens: int | None = None
        self._plan_expected = 0.0
        self._expected_of: dict[str, float] = {}
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._step_start = 0.0
        self._step_tokens = 0
        self._step_measurable = False

    def _new_proposer(self) -> Proposer:
        c = self.config
        if c.method == "suffix":
            return SuffixProposer(self.cache, c.suffix_decoding_max_tree_depth,
                                  c.suffix_decoding_max_spec_factor)
        return NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max)

    def stats_fields(self) -> dict[str, Any]:
        """SchedulerStats' spec_decode_* fields."""
        s = self.stats
        return {"spec_decode_num_drafts": s.num_drafts,
                "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(s.accepted_per_pos)}

    # ------------------------------------------------------------------ schedule()
    def propose(self, r: Request, budget: int, max_model_len: int, num_running: int
                ) -> list[int]:
        """Drafts for running request r, which is scheduled one token (its last) this step
        with `budget` tokens left after it; `num_running`: the step's requests, each
        expected to be one token and yield one before any drafts."""
        k = min(self.k, budget, max_model_len - r.num_computed_tokens - 1)
        if r.max_tokens is not None:
            k = min(k, r.max_tokens - r.num_output_tokens - 1)
        if k <= 0:
            return []
        st = self.states.get(r.request_id)
        if st is None:
            st = self.states[r.request_id] = _RequestState(self._new_proposer())
        drafts = st.proposer.propose(r.all_token_ids, k)
        sor = r.structured_output_request
        if drafts and sor is not None:
            # A draft the grammar refuses could never be kept: cut the drafts before it.
            drafts = drafts[:sor.grammar.validate_tokens(drafts)]
        if not drafts:
            return []
        if self.config.adaptive:
            if self._plan_tokens is None:
                self._plan_tokens, self._plan_expected = num_running, float(num_running)
            n, e = choose_num_drafts(st.alpha, len(drafts), self._plan_expected,
                                     self._plan_tokens, self.cost)
            if n == 0:
                st.shadow = drafts[0]
                return []
            drafts = drafts[:n]
            self._plan_tokens += n
            self._plan_expected += e
            self._expected_of[r.request_id] = e
        self.scheduled[r.request_id] = drafts
        return drafts

    def unpropose(self, request_id: str) -> bool:
        """Take back this step's drafts of a request (no KV room for them); False if none."""
        drafts = self.scheduled.pop(request_id, None)
        if drafts is None:
            return False
        if self._plan_tokens is not None:
            self._plan_tokens -= len(drafts)
            self._plan_expected -= self._expected_of.pop(request_id, 0.0)
        return True

    def forget(self, r: Request) -> None:
        """A request ends: its outputs join the suffix cache."""
        self.scheduled.pop(r.request_id, None)
        if self.states.pop(r.request_id, None) is not None and self.cache is not None:
            self.cache.add(r.output_token_ids)

    def take_scheduled(self, num_scheduled: dict[str, int], now: float
                       ) -> dict[str, list[int]]:
        """This step's drafts (of requests still scheduled), for SchedulerOutput; `now`, the
        engine's clock at schedule(), starts the step's clock when it is a decode/verify step
        whose time the cost model can use. The clock is the engine's, recorded in traces, so
        the policy's decisions depend only on recorded inputs and a trace replays exactly."""
        out = {rid: d for rid, d in self.scheduled.items() if rid in num_scheduled}
        self.scheduled = {}
        self._plan_tokens = None
        self._expected_of.clear()
        self._step_tokens = sum(num_scheduled.values())
        self._step_measurable = bool(num_scheduled) and max(num_scheduled.values()) <= self.k + 1
        self._step_start = now
        return out

    # ------------------------------------------------------------------ update_from_output()
    def step_done(self, now: float) -> None:
        """`now`: the engine's clock at update_from_output (callers without a clock pass the
        same time as at schedule(): nothing is measured)."""
        if self._step_measurable and now > self._step_start:
            self.cost.observe(self._step_tokens, now - self._step_start)
        self._step_measurable = False

    def roll_back(self, r: Request) -> None:
        """After verification: what is computed ends before the last kept token, as after a
        plain decode step (the optimistic advance counted every draft)."""
        r.num_computed_tokens = r.num_tokens - 1

    def on_output(self, r: Request, so: SchedulerOutput, generated: list[int],
                  running: bool) -> None:
        """Verification's result for r: `generated` is the accepted drafts plus one token;
        `running`: r was still running when the output came (not preempted meanwhile)."""
        drafts = so.scheduled_spec_decode_tokens.get(r.request_id)
        if drafts and running:
            self.roll_back(r)
        st = self.states.get(r.request_id)
        if not drafts:
            if st is not None and st.shadow is not None:
                st.alpha = update_alpha(st.alpha, int(generated[0] == st.shadow), 1)
                st.shadow = None
            return
        accepted = len(generated) - 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        if st is not None:
            st.alpha = update_alpha(st.alpha, accepted, min(accepted + 1, len(drafts)))
