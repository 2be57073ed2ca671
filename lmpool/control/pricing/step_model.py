"""A rank's step time as a function of its batch, fitted online from the steps it reports.

    seconds = base + prefill_tokens * s_per_prefill_token + attention * s_per_attention_pair
          + decode_seqs * s_per_decode_seq + decode_context * s_per_context_token
          + cascade_pairs * s_per_cascade_pair + prefill_keys * s_per_prefill_key

(``lmpool.protocol.StepSample`` says what each count is: a cascade's prefix pass has its own
coefficient, as its few query rows over many keys cost a pair more than a prefill's full tiles;
and the keys a prefill chunk reads have theirs, which is what sets short questions over a long
document apart from a long prompt of as many pairs.)
The fit minimises relative error (a 2 ms step counts as much as a 200 ms one: timing noise
grows with a step's length, and routing compares short steps too) by non-negative least squares
over exponentially decayed sums (a sample's weight halves every ``half_life`` samples, so the
fit follows a GPU whose neighbours come and go), with a ridge toward a prior: a rough figure
until the rank's calibration steps arrive, their fit from then on. A feature the recent steps
do not vary (no prefill for a while) thus falls back to what calibration measured rather than
to noise, or to the prior where calibration had none of it either (an engine without cascades).
Coefficients are fitted as multiples of the prior's (``_scales``), so the ridge weighs each
one's relative departure alike; a calibration first finds each coefficient's magnitude, so its
few steps can move one any distance from a prior made for another machine (``calibrate``).
Once fitted, a sample far from the prediction (a stall, a collection) counts as a bounded
miss, not at its full weight.

Invariants: the coefficients are finite and >= 0, so a predicted step never gets shorter
when any count grows; ``observe`` takes samples in any number, ``predict`` is plain floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from lmpool.protocol import StepSample

HALF_LIFE = 2000  # samples
RIDGE = 0.5  # the prior's weight, in samples' worth of relative error per coefficient
FITTED = 32  # samples after which a far miss is bounded
MISS = 4.0  # a sample counts as at most this many times (and at least 1/this of) its prediction
# A calibration's ridge toward a prior made for another machine and model, as a share of the
# online fit's toward the calibration: the calibration's three shapes inform a coefficient in a
# few steps each, and at the full ridge an engine 8 times the prior was priced up to a third too
# fast on those very shapes (``tests/control/test_pricing.py``).
CALIBRATION_RIDGE = 0.2
UNIT_FLOOR = 0.01  # the online fit's scale of a coefficient is at least this share of its unit (``_units``)


class StepCoefficients(NamedTuple):
    """Seconds per step and per unit of each count."""

    base: float
    prefill_token: float
    attention_pair: float
    decode_seq: float
    context_token: float
    cascade_pair: float
    prefill_key: float = 0.0

    def step_s(self, prefill_tokens: float, attention: float, decode_seqs: float, context: float,
               cascade: float = 0.0, keys: float = 0.0) -> float:
        return (self.base + self.prefill_token * prefill_tokens + self.attention_pair * attention
                + self.decode_seq * decode_seqs + self.context_token * context + self.cascade_pair * cascade
                + self.prefill_key * keys)

    def predict(self, s: StepSample) -> float:
        """The seconds of a step of ``s``'s shape."""
        return self.step_s(s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context, s.cascade_pairs,
                           s.prefill_keys)


# A rough prior for a replica before it reports anything (an H200 quarter, 0.6B shape): the
# calibration samples that follow replace it within a few steps. A cascade's pair at twice a
# prefill's: a prefix pass runs a few tiles of query rows (a group's rows times its q heads per
# kv head, 64 a tile), split over the keys to fill the GPU and merged; on an H100 quarter, cascade
# steps priced at the prefill's pair (7 ns) came to 0.6 of their measured time: about 15 ns a
# pair, for the 32 to 64 rows a rank decoded over a 16k document. A prefill's key at about 100 ns:
# on an H200 quarter at 26eac10, the steps of a 16k document's questions and chunks fitted 13.5 us
# a token, 1.9 ns a pair and 109 ns a key (92 % of them within 25 %; without keys, 63 %).
DEFAULT_PRIOR = StepCoefficients(base=3e-3, prefill_token=25e-6, attention_pair=5e-9, decode_seq=50e-6,
                                 context_token=0.1e-6, cascade_pair=10e-9, prefill_key=100e-9)
_FLOOR = np.array(DEFAULT_PRIOR) * 1e-3  # a coefficient's scale where its prior is (near) zero
FEATURES = len(StepCoefficients._fields)  # a step's counts, the base's 1 first (``step_features``)


def step_features(s: StepSample) -> tuple:
    """What each coefficient multiplies in a step of ``s``'s shape, in their order."""
    return 1.0, s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context, s.cascade_pairs, s.prefill_keys


def _timed(samples: Iterable[StepSample]) -> list[StepSample]:
    return [s for s in samples if s.seconds > 0 and math.isfinite(s.seconds)]


def _solve_or_fit(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a x = b``; least squares where ``a`` is singular: rows of wildly unlike scales (a step far
    faster than the prior) can leave the ridge lost in rounding."""
    try:
        return np.linalg.solve(a, b)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(a, b, rcond=None)[0]


def _units(rows: np.ndarray, seconds: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Each coefficient's unit in timed steps of these ``rows`` (features) and ``seconds``: the
    median, over the steps that have its feature, of their seconds per unit of it (the
    coefficient at which that feature alone would take the whole step); ``fallback``'s where no
    step has it. A departure of one unit changes such a step by about its whole length."""
    units = fallback.astype(float).copy()
    for j in range(rows.shape[1]):
        has = rows[:, j] > 0
        if has.any():
            units[j] = float(np.median(seconds[has] / rows[has, j]))
    return units


class StepModel:
    def __init__(self, prior: StepCoefficients = DEFAULT_PRIOR, half_life: float = HALF_LIFE,
                 ridge: float = RIDGE) -> None:
        if not half_life > 0 or not ridge > 0:
            raise ValueError(f"need half_life > 0 and ridge > 0, got {half_life}, {ridge}")
        self.decay = 0.5 ** (1.0 / half_life)
        self.ridge = ridge
        # Decayed sums of x x' and x over the relative rows: a step's features times the scales, over
        # its seconds (fitting them to 1, in multiples of the scales, minimises relative error).
        self._xx = np.zeros((FEATURES, FEATURES))
        self._x = np.zeros(FEATURES)
        self.samples = 0  # observed since the last calibration
        self.calibrated = False
        self.error = 0.0  # decayed mean |relative error| of the predictions, before each sample
        self.reseed(prior)

    def calibrate(self, samples: Iterable[StepSample]) -> StepCoefficients:
        """A worker's calibration steps: their fit becomes the prior, and the decayed sums start
        afresh (a restarted worker is a new machine state). The prior is a rough figure for one
        machine and model, and the calibration's few steps must be able to move a coefficient by
        any factor (a CPU's attention pair costs ~100 times an H200 quarter's): ridged in
        multiples of the prior, as the online fit is, a coefficient 100 times its prior cost
        the fit thousands of samples' worth and stayed near the prior. The online fit then moves
        each coefficient in multiples of itself, or of ``UNIT_FLOOR`` of its unit (``_units``)
        where that is larger: one calibrated near 0 could otherwise never leave it."""
        timed = _timed(samples)
        if timed:
            rows, seconds = np.array([step_features(s) for s in timed]), np.array([s.seconds for s in timed])
            units = _units(rows, seconds, self._scales)
            # Twice: the first fit, ridged in the samples' units, only finds each coefficient's
            # magnitude; the second is ridged in multiples of that magnitude or the prior's,
            # whichever is larger: a coefficient the steps put far above its prior is free to go
            # there, and where nearly collinear counts leave a direction uncertain (a decoding
            # sequence and its context, the base and a decoding sequence) the prior still holds,
            # if more loosely than a calibration holds the online fit (``CALIBRATION_RIDGE``).
            first = np.array(self._fit(rows, seconds, units, self.ridge))
            scales = np.maximum(first, self._scales)
            fit = np.array(self._fit(rows, seconds, scales, CALIBRATION_RIDGE * self.ridge))
            self.reseed(StepCoefficients(*(float(v) for v in fit)), floor=UNIT_FLOOR * units)
            self.calibrated = True
        return self.coefficients

    def _fit(self, rows: np.ndarray, seconds: np.ndarray, scales: np.ndarray, ridge: float) -> StepCoefficients:
        """The fit of steps of features ``rows`` taking ``seconds``, ridged by ``ridge`` toward
        the prior in multiples of ``scales``."""
        x = rows * scales / seconds[:, None]
        return self._solve(x.T @ x, x.sum(axis=0), scales, ridge)

    def reseed(self, prior: StepCoefficients, floor: np.ndarray = _FLOOR) -> None:
        """Start afresh from ``prior``: the fit forgets every sample. Each coefficient is fitted
        in multiples of its prior's, or of ``floor`` where that is larger."""
        self._prior = np.array(prior, dtype=float)
        self._scales = np.maximum(self._prior, floor)
        self._xx[:] = 0.0
        self._x[:] = 0.0
        self.samples = 0
        self.coefficients = StepCoefficients(*(float(v) for v in self._prior))

    def observe(self, samples: Iterable[StepSample]) -> None:
        """Fold measured steps into the fit (oldest first), then refit."""
        timed = _timed(samples)
        if not timed:
            return
        y = np.array([s.seconds for s in timed])
        features = np.array([step_features(s) for s in timed])
        predicted = features @ np.array(self.coefficients)
        k = len(timed)
        self.error = self.error * 0.99 ** k + (1 - 0.99 ** k) * float(np.mean(np.abs(y - predicted) / y))
        if self.samples >= FITTED:
            y = np.clip(y, predicted / MISS, predicted * MISS)
        x = features * self._scales / y[:, None]
        w = self.decay ** np.arange(k - 1, -1, -1)  # the newest weighs 1
        self._xx = self._xx * self.decay ** k + (x * w[:, None]).T @ x
        self._x = self._x * self.decay ** k + w @ x
        self.samples += k
        self.coefficients = self._solve(self._xx, self._x)

    def predict(self, s: StepSample) -> float:
        return self.coefficients.predict(s)

    def _solve(self, xx: np.ndarray, x: np.ndarray, scales: np.ndarray | None = None,
               ridge: float | None = None) -> StepCoefficients:
        """argmin over u >= 0 of sum (1 - row u)^2 + ridge |u - prior / scales|^2, from the sums
        of row row' and of row (rows in multiples of ``scales``; the fit's own scales and ridge
        by default): solve on the free set, pin the most negative multiple at 0, repeat (once per
        coefficient at most); the coefficients are u times the scales."""
        scales = self._scales if scales is None else scales
        ridge = self.ridge if ridge is None else ridge
        a = xx + ridge * np.eye(len(x))
        b = x + ridge * self._prior / scales
        free = list(range(len(x)))
        u = np.zeros(len(x))
        while free:
            sub = _solve_or_fit(a[np.ix_(free, free)], b[free])
            if (sub >= 0).all():
                u[free] = sub
                break
            del free[int(np.argmin(sub))]
        return StepCoefficients(*(float(v) for v in u * scales))
