"""On only where it pays: how many drafts a request gets in this step.

Two measurements drive the rule. Per request, `alpha`, the chance that a draft token is
accepted given the ones before it were (an exponential average over verified positions,
and over shadow proposals that were not verified: with speculation off for a request its
proposals are still compared with what the model then produced). Per engine, C(T), the
seconds of a decode/verify step of T scheduled tokens: a table measured from the steps
themselves (StepCostTable), not a formula, because the quantized kernels' cost steps with
their row tiles and is far from linear at small T.

The step is planned in scheduler order. With P tokens expected from the step so far (one
per decoding request plus the expected accepted drafts of the requests before) and T tokens
scheduled, k drafts for the next request, with E(k) = alpha + ... + alpha^k, pay when

    (P + E(k)) / C(T + k)  >  (1 + MARGIN) * P / C(T)

The request gets the k in 1..K that maximises the left side, if it passes; P and T then
grow by E(k) and k for the requests after it. At large batch C(T + k) / C(T) approaches
(T + k) / T while E(k) < k: speculation turns itself off.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

# Before a request is measured: the acceptance a proposal that exists at all tends to have.
ALPHA_PRIOR = 0.6
ALPHA_WEIGHT = 0.15
# A gain must beat the step-time noise of the measured table by this much (relative).
MARGIN = 0.04
# Each measured step moves its T's average this far (the first sets it).
COST_WEIGHT = 0.2
# The prior: the relative seconds of a decode/verify step of T tokens (Gemma 3 270M Q4_K_M,
# one thread, this machine), linear between the points and past the last. From
# benchmarks/spec_step_cost.py under load (5 other jobs on 2 cores), smoothed by hand: a
# verify step of 8 rows cost 1.5x a decode step at one sequence, and past 32 tokens a step
# cost about 7 ms per token with no fixed part to speak of (so drafts at high batch cost as
# much as they bring). It only shapes the table where a T was never measured.
PRIOR: tuple[tuple[int, float], ...] = (
    (1, 1.0), (4, 1.15), (8, 1.55), (16, 2.4), (32, 4.4), (64, 8.5), (128, 16.5), (256, 32.5))


def prior_cost(tokens: int) -> float:
    """PRIOR at `tokens`, interpolated linearly (extrapolated past its last point)."""
    pts = PRIOR
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, c0), (t1, c1) in zip(pts, pts[1:], strict=False):
        if tokens <= t1:
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    (t0, c0), (t1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) * (tokens - t1) / (t1 - t0)


@dataclass(slots=True)
class StepCostTable:
    """Seconds of a decode/verify step by its scheduled tokens T, an exponential average per
    T measured on the engine clock. A T never measured is the prior's shape scaled to the
    measured T's on either side of it (linearly between their scales), so one measured
    batch size already sets the table's scale for all."""

    seconds: dict[int, float] = field(default_factory=dict)
    measured: list[int] = field(default_factory=list)  # sorted keys of `seconds`

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        if old is None:
            self.seconds[tokens] = seconds
            insort(self.measured, tokens)
        else:
            self.seconds[tokens] = old + COST_WEIGHT * (seconds - old)

    def _scale(self, tokens: int) -> float:
        return self.seconds[tokens] / prior_cost(tokens)

    def estimate(self, tokens: int) -> float:
        """C(tokens); before any measurement, in the prior's units."""
        got = self.seconds.get(tokens)
        if got is not None:
            return got
        keys = self.measured
        if not keys:
            return prior_cost(tokens)
        i = bisect_left(keys, tokens)
        if i == 0:
            scale = self._scale(keys[0])
        elif i == len(keys):
            scale = self._scale(keys[-1])
        else:
            lo, hi = keys[i - 1], keys[i]
            s_lo, s_hi = self._scale(lo), self._scale(hi)
            scale = s_lo + (s_hi - s_lo) * (tokens - lo) / (hi - lo)
        return scale * prior_cost(tokens)


def choose_num_drafts(alpha: float, k_max: int, expected: float, num_tokens: int,
                      cost: StepCostTable) -> tuple[int, float]:
    """(k, E(k)) for a request whose proposal has k_max tokens, in a step that so far
    schedules `num_tokens` tokens and expects `expected` tokens; (0, 0.0) if no k pays."""
    base = expected / cost.estimate(num_tokens) * (1.0 + MARGIN)
    best_k, best_e, best_rate = 0, 0.0, base
    e = 0.0
    for k in range(1, k_max + 1):
        e += alpha ** k
        rate = (expected + e) / cost.estimate(num_tokens + k)
        if rate > best_rate:
            best_k, best_e, best_rate = k, e, rate
    return best_k, best_e


def update_alpha(alpha: float, accepted: int, tried: int) -> float:
    """Fold `tried` verified positions (the first `accepted` of them accepted) into alpha."""
    for i in range(tried):
        alpha += ALPHA_WEIGHT * ((1.0 if i < accepted else 0.0) - alpha)
    return alpha
