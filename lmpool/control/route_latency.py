"""Route-decision latency as a cumulative histogram, for the pool-state board.

The control process observes every decision's seconds; the board carries the counts at or below
each bound of ``ROUTE_LATENCY_BUCKETS_S`` and the sum, so the Prometheus exporter serves a true
histogram (rates and quantiles over any window, aggregated across pools) where a quantile gauge
of recent decisions could not be. Counts are cumulative per control process: a restarted one
starts again from zero, as a counter reset.
"""

from __future__ import annotations

from bisect import bisect_left

from lmpool.protocol.state_board import ROUTE_LATENCY_BUCKETS_S


class RouteLatency:
    def __init__(self) -> None:
        self._counts = [0] * len(ROUTE_LATENCY_BUCKETS_S)  # per bucket, not cumulative; past the last: none
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.sum_s += seconds
        at = bisect_left(ROUTE_LATENCY_BUCKETS_S, seconds)  # the first bound >= seconds (Prometheus' le)
        if at < len(self._counts):
            self._counts[at] += 1

    def cumulative(self) -> list[int]:
        """Decisions at or below each bound."""
        out, total = [], 0
        for count in self._counts:
            total += count
            out.append(total)
        return out
