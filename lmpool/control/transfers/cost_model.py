"""What a KV transfer costs, from a calibration profile corrected online.

A calibration run (``benchmarks/benchmark_kv_transfer.py``) measures each
directed pair at several sizes and writes a profile: the P95 latency of the
data path (pack, send, receive, unpack) per block count, and optionally the
P95 residual of the rest of a transaction (dispatch to publish, minus the data
path) per size bucket. The estimate for moving ``n`` blocks over a pair is

    (residual_P95(pair, bucket(n)) + interference * data_path_P95(pair, n)) * correction(pair, bucket(n))

where ``data_path_P95`` interpolates the measured curve linearly in block count
(and extrapolates past the largest size at the last segment's per-block
slope), and ``correction`` is an EWMA of observed / estimated seconds, so a
profile taken on a quiet machine adapts to a busy one.

Without a profile, ``uncalibrated`` starts from a plain link model (a fixed
cost plus bytes over bandwidth, one curve for every pair) that the same EWMAs
then correct from the pool's own completed plans.

Invariants: a profile is only accepted for a model whose KV bytes per block
match the profile's (``config/transfer_profile.py`` checks it);
estimates are positive and non-decreasing in ``n`` for a fixed pair. An estimate is
remembered until the next ``observe`` (the one way a model changes once made: its
curves are fixed, its corrections move only there), so routing's pull options, which
ask for the same few pairs and sizes route after route, pay one lookup for it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

from lmpool.config.transfer_profile import TransferProfile

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(num_blocks: int) -> int:
    """The size bucket of a transfer: the largest calibrated power of two not above it."""
    i = bisect.bisect_right(BUCKETS, max(1, num_blocks)) - 1
    return BUCKETS[i]


@dataclass
class PairCurve:
    sizes: list[int]  # block counts, ascending
    p95_s: list[float]

    def __post_init__(self) -> None:
        # Noise can make a larger size measure faster; moving more blocks never costs less.
        for i in range(1, len(self.p95_s)):
            self.p95_s[i] = max(self.p95_s[i], self.p95_s[i - 1])

    def at(self, num_blocks: int) -> float:
        sizes, times = self.sizes, self.p95_s
        if len(sizes) == 1:
            return times[0]
        if num_blocks <= sizes[0]:
            return times[0]
        i = min(bisect.bisect_left(sizes, num_blocks), len(sizes) - 1)
        lo, hi = i - 1, i
        slope = max(0.0, (times[hi] - times[lo]) / (sizes[hi] - sizes[lo]))
        return times[lo] + slope * (num_blocks - sizes[lo])


@dataclass
class TransferCostModel:
    kv_bytes_per_block: int
    curves: dict[str, PairCurve]
    residuals: dict[str, PairCurve] = field(default_factory=dict)
    interference: float = 1.0  # > 1 when the data path shares the GPU with running batches
    ewma_alpha: float = 0.2
    correction: dict[tuple[str, int], float] = field(default_factory=dict)
    # The slowest measured curves, which unmeasured pairs borrow (found once: curves never change).
    _slowest_curve: PairCurve | None = field(default=None, init=False, repr=False)
    _slowest_residual: PairCurve | None = field(default=None, init=False, repr=False)
    _estimates: dict[tuple[int, int, int], float] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    @classmethod
    def from_profile(cls, profile: dict | str | Path, kv_bytes_per_block: int, **kwargs) -> TransferCostModel:
        """The model of a profile (dict or JSON file, ``TransferProfile``) for a model with ``kv_bytes_per_block``."""
        read = TransferProfile.read(profile, kv_bytes_per_block)
        curves = {pair: PairCurve(sorted(points), [points[n].p95_s for n in sorted(points)])
                  for pair, points in read.pairs.items()}
        residuals = {pair: PairCurve(sorted(by_size), [by_size[n] for n in sorted(by_size)])
                     for pair, by_size in read.residual_p95_s.items()}
        return cls(kv_bytes_per_block, curves, residuals, **kwargs)

    @classmethod
    def uncalibrated(cls, kv_bytes_per_block: int, fixed_s: float, bytes_per_s: float, **kwargs) -> TransferCostModel:
        """A link model for a pool without a calibration profile: ``fixed_s + bytes / bytes_per_s``
        at every calibrated size, for every pair (corrected online like any profile)."""
        if kv_bytes_per_block < 1 or fixed_s < 0 or bytes_per_s <= 0:
            raise ValueError(
                f"need kv_bytes_per_block >= 1, fixed_s >= 0 and bytes_per_s > 0; got "
                f"{kv_bytes_per_block}, {fixed_s}, {bytes_per_s}"
            )
        times = [fixed_s + n * kv_bytes_per_block / bytes_per_s for n in BUCKETS]
        return cls(kv_bytes_per_block, {"*": PairCurve(list(BUCKETS), times)}, **kwargs)

    @staticmethod
    def pair_key(src: int, dst: int) -> str:
        return f"{src}->{dst}"

    def _curve(self, pair: str) -> PairCurve:
        curve = self.curves.get(pair)
        if curve is None:
            # Pairs of one kind behave alike (same link type): borrow the slowest measured one.
            if not self.curves:
                raise ValueError("transfer profile holds no pairs")
            if self._slowest_curve is None:
                self._slowest_curve = max(self.curves.values(), key=lambda c: c.at(BUCKETS[-1]))
            curve = self._slowest_curve
        return curve

    def data_path_p95(self, src: int, dst: int, num_blocks: int) -> float:
        return self._curve(self.pair_key(src, dst)).at(num_blocks)

    def residual_p95(self, src: int, dst: int, num_blocks: int) -> float:
        """Dispatch-to-publish time beyond the data path, interpolated between measured buckets.
        A pair the profile did not measure borrows the slowest measured pair's, as its data
        path does (a calibration on two ranks serves a pool of more)."""
        return self._residual(self.pair_key(src, dst), bucket(num_blocks))

    def _residual(self, pair: str, size: int) -> float:
        curve = self.residuals.get(pair)
        if curve is None and self.residuals:
            if self._slowest_residual is None:
                self._slowest_residual = max(self.residuals.values(), key=lambda c: c.at(BUCKETS[0]))
            curve = self._slowest_residual
        return curve.at(size) if curve is not None else 0.0

    def estimate(self, src: int, dst: int, num_blocks: int) -> float:
        """Expected seconds from dispatch to publish for ``num_blocks`` blocks over src -> dst."""
        key = (src, dst, num_blocks)
        seconds = self._estimates.get(key)
        if seconds is None:
            pair, size = self.pair_key(src, dst), bucket(num_blocks)
            raw = self._residual(pair, size) + self.interference * self._curve(pair).at(num_blocks)
            seconds = self._estimates[key] = raw * self.correction.get((pair, size), 1.0)
        return seconds

    def observe(self, src: int, dst: int, num_blocks: int, seconds: float) -> None:
        """Fold one measured transaction into the pair and bucket's correction."""
        key = (self.pair_key(src, dst), bucket(num_blocks))
        raw = self.residual_p95(src, dst, num_blocks) + self.interference * self.data_path_p95(src, dst, num_blocks)
        if raw <= 0:
            return
        old = self.correction.get(key, 1.0)
        self.correction[key] = (1 - self.ewma_alpha) * old + self.ewma_alpha * (seconds / raw)
        self._estimates.clear()  # a correction moved: forget every estimate (a few dozen, redone on demand)
