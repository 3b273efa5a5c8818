"""Response lengths of one RL step: a lognormal cut at ``max_new_tokens``.

Why a distribution and not a mean: a synchronous step waits for its longest sample, so
its generation time is set by the tail (the batch's expected maximum, usually the cap),
while an asynchronous generator refills finished slots from the next batch and is bound
by the mean. The ratio of the two is much of what asynchrony buys.

A response longer than the cap is cut at it (``max_new_tokens`` tokens), so the lengths
are ``min(L, cap)`` with ``L`` lognormal (median ``median_frac * cap``, log-space standard
deviation ``sigma``). Pure logic: ``math`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BINS = 64  # decode steps are integrated over this many equal slices of [0, longest]


def _phi(z: float) -> float:
    """The standard normal CDF."""
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _phi_inv(p: float) -> float:
    """The standard normal quantile (bisection: called a few times per simulation)."""
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _phi(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Lengths:
    """Response lengths ``min(L, cap)``, ``L`` lognormal with ``median`` and ``sigma``."""

    cap: int
    median: float
    sigma: float

    @classmethod
    def relative(cls, cap: int, median_frac: float, sigma: float) -> Lengths:
        return cls(cap, median_frac * cap, sigma)

    def survival(self, t: float) -> float:
        """P(length > t): the share of a batch's samples still decoding at step t."""
        if t >= self.cap:
            return 0.0
        if t <= 0:
            return 1.0
        if self.sigma == 0:
            return 1.0 if t < self.median else 0.0
        return 1.0 - _phi((math.log(t) - math.log(self.median)) / self.sigma)

    def quantile(self, p: float) -> float:
        if self.sigma == 0:
            return min(self.median, self.cap)
        return min(self.median * math.exp(self.sigma * _phi_inv(p)), float(self.cap))

    def mean(self) -> float:
        """E[min(L, cap)] = the integral of the survival function up to the cap."""
        return sum(w * self.survival(t) for t, w in self.grid(self.cap))

    def longest(self, n: int) -> float:
        """The expected longest of ``n`` samples (the ``n / (n + 1)`` quantile)."""
        return self.quantile(n / (n + 1))

    @staticmethod
    def grid(end: float) -> list[tuple[float, float]]:
        """Midpoints and widths of :data:`BINS` slices of ``[0, end]``."""
        w = end / BINS
        return [((i + 0.5) * w, w) for i in range(BINS)]
