"""The prefill each rank has lately been routed, as a rate: what a price expects to join a
request's step before that step is scheduled (``Pricer``'s joiners).

A route that does not wait on a pull adds the prompt tokens its request computes there, their
attention pairs and the keys they read to its rank's sums, which decay exponentially with time
constant ``tau_s``: a sum over ``tau_s`` is the rate (per second) that a steady stream of such
routes would show, and it falls back to 0 once routes stop.

Invariants: every sum is >= 0, and between two routes to a rank its sums only decay; a rank
never routed to has rates 0.
"""

from __future__ import annotations

import math

# About a step of a burst's (tens of milliseconds): long enough that a few routes make a rate,
# short enough that the rate is gone a few steps after the burst.
ARRIVAL_TAU_S = 0.05


class Arrivals:
    def __init__(self, world_size: int, tau_s: float = ARRIVAL_TAU_S) -> None:
        if tau_s <= 0:
            raise ValueError(f"need tau_s > 0, got {tau_s}")
        self.tau_s = tau_s
        self._at = [0.0] * world_size  # when each rank's sums were last decayed
        self._sums = [(0.0, 0.0, 0.0)] * world_size  # (tokens, attention pairs, keys)

    def add(self, rank: int, tokens: int, attention: int, keys: int, now: float) -> None:
        """A route sent ``rank`` this prefill at ``now``."""
        t, a, k = self._decayed(rank, now)
        self._sums[rank] = (t + tokens, a + attention, k + keys)
        self._at[rank] = now

    def rates(self, rank: int, now: float) -> tuple[float, float, float]:
        """Tokens, attention pairs and keys per second routed to ``rank`` lately, as of ``now``."""
        t, a, k = self._decayed(rank, now)
        tau = self.tau_s
        return t / tau, a / tau, k / tau

    def _decayed(self, rank: int, now: float) -> tuple[float, float, float]:
        t, a, k = self._sums[rank]
        if not (t or a or k):
            return 0.0, 0.0, 0.0
        elapsed = now - self._at[rank]
        if elapsed <= 0:
            return t, a, k
        f = math.exp(-elapsed / self.tau_s)
        return t * f, a * f, k * f
