"""On only where it pays: how many drafts a request gets in this step.

Two measurements drive the rule. Per request, `alpha`, the chance that a draft token is
accepted given the ones before it were (an exponential average over verified positions,
and over shadow proposals that were not verified: with speculation off for a request its
proposals are still compared with what the model then produced). Per engine, the step time
as a + b * T over the scheduled tokens T of decode/verify steps (least squares with
forgetting, from the steps themselves).

With N requests decoding in the step and T tokens, k drafts for one request add b * k to
the step and E(k) = alpha + ... + alpha^k expected tokens to the N it produces anyway, so
they pay when

    (N + E(k)) / (a + b * (T + k))  >  N / (a + b * T),   i.e.   E(k) * (a + b * T) > N * b * k.

The request gets the k in 1..K that maximises E(k) * (a + b * T) - N * b * k, if positive.
At large N the right side grows with N while E(k) < k: speculation turns itself off.
"""

from __future__ import annotations

from dataclasses import dataclass

# Before a request is measured: the acceptance a proposal that exists at all tends to have.
ALPHA_PRIOR = 0.6
ALPHA_WEIGHT = 0.15
# Before the cost is measured: k verified tokens cost this fraction of a one-token step each
# (weights are read once per step; one thread on a 270M model: measured near 0.1).
COST_RATIO_PRIOR = 0.15
_FORGET = 0.97


@dataclass(slots=True)
class StepCostModel:
    """Weighted least squares of step seconds on scheduled tokens, with forgetting, seeded
    by two pseudo-steps from the prior at the scale of the first measured step."""

    s1: float = 0.0
    st: float = 0.0
    stt: float = 0.0
    sy: float = 0.0
    sty: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if self.s1 == 0.0:
            a = seconds / (1 + COST_RATIO_PRIOR * (tokens - 1))
            for t in (1, 9):
                self._add(t, a * (1 + COST_RATIO_PRIOR * (t - 1)), 2.0)
        f = _FORGET
        self.s1, self.st, self.stt, self.sy, self.sty = (
            self.s1 * f, self.st * f, self.stt * f, self.sy * f, self.sty * f)
        self._add(tokens, seconds, 1.0)

    def _add(self, t: float, y: float, w: float) -> None:
        self.s1 += w
        self.st += w * t
        self.stt += w * t * t
        self.sy += w * y
        self.sty += w * t * y

    def coefficients(self) -> tuple[float, float]:
        """(a, b); before any measurement the prior's shape at unit scale."""
        if self.s1 == 0.0:
            return 1.0, COST_RATIO_PRIOR
        var = self.s1 * self.stt - self.st * self.st
        if var <= 1e-12:
            return self.sy / self.s1, COST_RATIO_PRIOR * self.sy / self.s1
        b = (self.s1 * self.sty - self.st * self.sy) / var
        a = (self.sy - b * self.st) / self.s1
        # Noise can make either coefficient negative; a verify token is never free.
        a = max(a, 1e-9)
        return a, max(b, 0.01 * a)


def expected_accepted(alpha: float, k: int) -> float:
    """alpha + alpha^2 + ... + alpha^k: the expected accepted drafts of k."""
    return sum(alpha ** i for i in range(1, k + 1))


def choose_num_drafts(alpha: float, k_max: int, num_reqs: int, num_tokens: int,
                      cost: StepCostModel) -> int:
    a, b = cost.coefficients()
    step = a + b * num_tokens
    best_k, best_gain = 0, 0.0
    e = 0.0
    for k in range(1, k_max + 1):
        e += alpha ** k
        gain = e * step - num_reqs * b * k
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


def update_alpha(alpha: float, accepted: int, tried: int) -> float:
    """Fold `tried` verified positions (the first `accepted` of them accepted) into alpha."""
    for i in range(tried):
        alpha += ALPHA_WEIGHT * ((1.0 if i < accepted else 0.0) - alpha)
    return alpha
