"""The prefill each rank has lately been routed, as a rate: what a price expects to join a
request's step before that step is scheduled (``Pricer``'s joiners).

Each route adds its request's prefill there, in the rank's predicted seconds when it was routed,
to the rank's sum (a request waiting on a pull too: those start together once it lands), which
decays exponentially with time constant ``tau_s``: the sum over ``tau_s`` is the rate (prefill
seconds per second) that a steady stream of such routes would show, and it falls back to 0 once
routes stop.

Invariants: every sum is >= 0, and between two routes to a rank its sum only decays; a rank
never routed to has rate 0.
"""

from __future__ import annotations

import math

# About a step of a burst's (tens of milliseconds): long enough that a few routes make a rate,
# short enough that the rate is gone a few steps after the burst.
ARRIVAL_TAU_S = 0.05


class Arrivals:
    __slots__ = ("tau_s", "at", "sums")

    def __init__(self, world_size: int, tau_s: float = ARRIVAL_TAU_S) -> None:
        if tau_s <= 0:
            raise ValueError(f"need tau_s > 0, got {tau_s}")
        self.tau_s = tau_s
        # Read-only outside: a price reads them inlined (``Pricer.price_work``).
        self.at = [0.0] * world_size  # when each rank's sum was last decayed
        self.sums = [0.0] * world_size  # decayed prefill seconds, as of ``at``

    def add(self, rank: int, seconds: float, now: float) -> None:
        """A route sent ``rank`` ``seconds`` of prefill at ``now``."""
        if seconds < 0:
            raise ValueError(f"need seconds >= 0, got {seconds}")
        self.sums[rank] = self._decayed(rank, now) + seconds
        self.at[rank] = now

    def rate(self, rank: int, now: float) -> float:
        """Prefill seconds per second routed to ``rank`` lately, as of ``now``."""
        return self._decayed(rank, now) / self.tau_s if self.sums[rank] else 0.0

    def _decayed(self, rank: int, now: float) -> float:
        s = self.sums[rank]
        elapsed = now - self.at[rank]
        return s * math.exp(-elapsed / self.tau_s) if s and elapsed > 0 else s
