"""On only where it pays: how many drafts a request gets in this step.

Two measurements drive the rule. Per request, `alpha`, the chance that a draft token is
accepted given the ones before it were (an exponential average over verified positions,
and over shadow proposals that were not verified: with speculation off for a request its
proposals are still compared with what the model then produced). Per engine, C(T), the
seconds of a decode/verify step of T scheduled tokens: a table measured from the steps
themselves (StepCostTable) over a prior measured on this machine, not a formula, because the
quantized kernels' cost steps with their row tiles and is far from linear at small T.

The step is planned in scheduler order. With P tokens expected from the step so far (one
per decoding request plus the expected accepted drafts of the requests before) and T tokens
scheduled, k drafts for the next request, with E(k) = alpha + ... + alpha^k, pay when

    (P + E(k)) / C(T + k)  >  (1 + MARGIN) * P / C(T)

by the measured table and by the prior at the measured scale both. The request gets the k
in 1..K with the largest gain (the smaller of the two), if it passes; P and T then
grow by E(k) and k for the requests after it. At large batch C(T + k) / C(T) approaches
(T + k) / T while E(k) < k: speculation turns itself off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Before a request is measured: the acceptance a proposal that exists at all tends to have.
ALPHA_PRIOR = 0.6
ALPHA_WEIGHT = 0.15
# A gain must beat the step-time noise of the measured table by this much (relative).
MARGIN = 0.04
# Each measured step moves its T's average this far (the first sets it), and the scale of
# the whole table by SCALE_WEIGHT. The prior counts as PRIOR_COUNT steps against a T's own
# (at most MAX_COUNT of them): a T's measurement wins only once several steps agree.
COST_WEIGHT = 0.2
SCALE_WEIGHT = 0.05
PRIOR_COUNT = 4
MAX_COUNT = 16
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
    """Seconds of a decode/verify step by its scheduled tokens T, measured on the engine
    clock. Every step moves one scale (seconds per prior unit, over all T's); each T also
    keeps its own average, which outweighs the scaled prior as its steps accumulate. A T
    never measured is the prior at the measured scale; a T measured a few times in a noisy
    spell (other processes on the cores) stays near the prior until more steps agree."""

    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    scale: float = 0.0  # 0: nothing measured yet

    def observe(self, tokens: int, seconds: float) -> None:
        s = seconds / prior_cost(tokens)
        self.scale = s if self.scale == 0.0 else self.scale + SCALE_WEIGHT * (s - self.scale)
        old = self.seconds.get(tokens)
        n = self.counts.get(tokens, 0)
        self.seconds[tokens] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self.counts[tokens] = min(n + 1, MAX_COUNT)

    def estimate(self, tokens: int) -> float:
        """C(tokens); before any measurement, in the prior's units."""
        prior = prior_cost(tokens) * (self.scale or 1.0)
        n = self.counts.get(tokens, 0)
        if n == 0:
            return prior
        return (n * self.seconds[tokens] + PRIOR_COUNT * prior) / (n + PRIOR_COUNT)


def choose_num_drafts(alpha: float, k_max: int, expected: float, num_tokens: int,
                      cost: StepCostTable) -> tuple[int, float]:
    """(k, E(k)) for a request whose proposal has k_max tokens, in a step that so far
    schedules `num_tokens` tokens and expects `expected` tokens; (0, 0.0) if no k pays.
    The gain must hold by the measured table and by the prior at the measured scale both:
    a step timed fast in a quiet moment cannot turn speculation on where the prior's shape
    says it costs, nor can the prior where the table measured the cost."""
    measured = cost.estimate
    scale = cost.scale or 1.0

    def scaled(t: int) -> float:
        return prior_cost(t) * scale

    base_m = expected / measured(num_tokens)
    base_p = expected / scaled(num_tokens)
    best_k, best_e, best_gain = 0, 0.0, 1.0 + MARGIN
    e = 0.0
    for k in range(1, k_max + 1):
        e += alpha ** k
        t = num_tokens + k
        gain = min((expected + e) / measured(t) / base_m, (expected + e) / scaled(t) / base_p)
        if gain > best_gain:
            best_k, best_e, best_gain = k, e, gain
    return best_k, best_e


def update_alpha(alpha: float, accepted: int, tried: int) -> float:
    """Fold `tried` verified positions (the first `accepted` of them accepted) into alpha."""
    for i in range(tried):
        alpha += ALPHA_WEIGHT * ((1.0 if i < accepted else 0.0) - alpha)
    return alpha
