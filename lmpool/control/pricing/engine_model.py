"""The pool's engine model: one step-time fit per rank (``step_model``), fed by its workers, and
the coefficients each rank is priced by.

A rank's fit starts from the prior, takes its worker's calibration steps when they arrive
(before the rank serves), then every step it reports. Replicas of one pool run one model
with one engine configuration, so they share one shape of step time: every rank is priced by
the pooled fit (each coefficient the median of the fits of the ranks that have run ``FITTED``
steps of their own; of the calibrations before any has: one rank's few noisy steps, a
calibration that paid a one-time cost, must not set every rank's price) times its own speed.
A rank's speed is its recent served steps' measured seconds over what the pooled fit predicts
for them (its last ``WINDOW``), 1 until it has run ``FITTED`` steps. One scalar is
identified by any steps a rank runs, where its own fit's seven coefficients are not: a rank
that has only read one long document cannot tell its decode cost from its base, and two such
twins, priced each by its own fit, differed by more than their real difference and split a
burst unevenly. A few synthetic steps timed while the other workers calibrate too are noisy, and
an idle rank's calibration goes stale while its twins' fits follow the machine as it is now;
either alone would make an idle replica look dearer or cheaper than its twin for the whole run.
The speed moves a rank's price where it really differs (a replica on a busier GPU). A rank that
restarts is a new engine state: its calibration resets its fit and its speed. ``describe`` is
what ``stats()`` and ``lmpool top`` show of a rank's fit; ``stats()`` also says how well its priced
coefficients predicted each kind of its steps (``step_accuracy``), since the rank's last calibration,
and that calibration's steps beside what its fit predicts for them.

Invariants: every rank has priced coefficients at all times (the prior until some worker has
reported); they change only when a report is observed, and then only by ``MOVE`` or more (a
rank's pricing work is cached on their identity); a rank's speed is finite and > 0, and 1 until
it has run ``FITTED`` steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from lmpool.control.pricing.step_accuracy import StepAccuracy, step_row
from lmpool.control.pricing.step_model import FEATURES, FITTED, StepCoefficients, StepModel, step_features
from lmpool.protocol import StepFit, StepSample, StepTimings

WINDOW = 64  # a rank's recent served steps its speed is measured on
MOVE = 0.005  # a relative move of a priced coefficient below this keeps the old ones (far below the fit's error)


def _moved(old: StepCoefficients, new: StepCoefficients) -> bool:
    """Whether any coefficient moved by ``MOVE`` of itself or more."""
    return any(abs(b - a) >= MOVE * max(abs(a), abs(b)) for a, b in zip(old, new) if a != b)


def _median(fits: list[StepCoefficients]) -> StepCoefficients:
    """Each coefficient's median over ``fits`` (of two, their mean)."""
    return StepCoefficients(*(statistics.median(column) for column in zip(*fits)))


class RecentSteps:
    """A rank's last ``WINDOW`` timed steps, as running sums: their seconds, and their count and
    features (a prediction is linear in them, so the window's is one dot product)."""

    def __init__(self) -> None:
        self._steps: deque[StepSample] = deque()
        self._added = 0
        self.seconds = 0.0
        self.features = [0.0] * FEATURES  # sums of ``step_features``

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, s: StepSample) -> None:
        self._fold(s, 1.0)
        self._steps.append(s)
        if len(self._steps) > WINDOW:
            self._fold(self._steps.popleft(), -1.0)
        self._added += 1
        if self._added % WINDOW == 0:  # summed afresh now and then: additions and removals round
            self._resum()

    def clear(self) -> None:
        self._steps.clear()
        self._resum()

    def _resum(self) -> None:
        self.seconds, self.features = 0.0, [0.0] * FEATURES
        for s in self._steps:
            self._fold(s, 1.0)

    def _fold(self, s: StepSample, sign: float) -> None:
        f = self.features
        self.seconds += sign * s.seconds
        for j, v in enumerate(step_features(s)):
            f[j] += sign * v

    def speed(self, pooled: StepCoefficients) -> float:
        """Measured over ``pooled``'s predicted seconds of these steps (1 where nothing is predicted)."""
        predicted = sum(c * f for c, f in zip(pooled, self.features))
        return self.seconds / predicted if predicted > 0 else 1.0


class EngineModel:
    def __init__(self, world_size: int) -> None:
        self.ranks = [StepModel() for _ in range(world_size)]
        self._calibrations: dict[int, StepCoefficients] = {}  # rank -> its calibration's fit
        self._pooled: StepCoefficients | None = None  # the shape every rank is priced by
        self._recent = [RecentSteps() for _ in range(world_size)]
        self._speeds = [1.0] * world_size
        self._priced: list[StepCoefficients] = []  # by rank, once there is a pooled fit
        self._accuracy = [StepAccuracy() for _ in range(world_size)]  # of the priced coefficients, by kind of step
        # Each rank's last calibration steps, as ``StepFit.calibration`` lists them.
        self._calibration_steps: list[list[StepSample]] = [[] for _ in range(world_size)]

    def observe(self, timings: StepTimings) -> None:
        rank, model = timings.rank, self.ranks[timings.rank]
        if timings.calibration:
            self._calibrations[rank] = model.calibrate(timings.samples)
            self._calibration_steps[rank] = list(timings.samples)
            self._recent[rank].clear()
            self._accuracy[rank] = StepAccuracy()  # a restarted worker is a new engine state
        else:
            # Against what the routes priced this rank's steps with, before these steps move it.
            self._accuracy[rank].observe(timings.samples, self.coefficients(rank).predict)
            model.observe(timings.samples)
            recent = self._recent[rank]
            for s in timings.samples:
                if 0 < s.seconds < math.inf:  # timed, as the fit takes them
                    recent.add(s)
        fitted = [m.coefficients for m in self.ranks if m.samples >= FITTED]
        if fitted:
            self._pooled = _median(fitted)
        elif self._calibrations:
            self._pooled = _median(list(self._calibrations.values()))
        self._reprice()

    def _reprice(self) -> None:
        """Every rank's priced coefficients: the pooled fit times its speed. A rank keeps its
        coefficients (the same object) while none moved by ``MOVE`` or more: a pooled fit moves
        with every report, and every move re-prices the rank's work at the next route."""
        pooled = self._pooled
        if pooled is None:
            return
        before = self._priced
        priced = []
        for rank, model in enumerate(self.ranks):
            fitted = model.samples >= FITTED and self._recent[rank]
            s = self._speeds[rank] = self._recent[rank].speed(pooled) if fitted else 1.0
            c = StepCoefficients(*(s * v for v in pooled))
            if before and not _moved(before[rank], c):
                c = before[rank]
            priced.append(c)
        self._priced = priced

    def coefficients(self, rank: int) -> StepCoefficients:
        """What ``rank`` is priced by: the pooled fit times its speed; its own fit (the prior)
        until some worker has reported."""
        return self._priced[rank] if self._pooled is not None else self.ranks[rank].coefficients

    def describe(self, rank: int) -> StepFit:
        model = self.ranks[rank]
        c = self.coefficients(rank)
        return StepFit(base_ms=c.base * 1e3, prefill_us_per_token=c.prefill_token * 1e6,
                       attention_ns_per_pair=c.attention_pair * 1e9, decode_us_per_seq=c.decode_seq * 1e6,
                       context_us_per_token=c.context_token * 1e6, cascade_ns_per_pair=c.cascade_pair * 1e9,
                       prefill_ns_per_key=c.prefill_key * 1e9,
                       samples=model.samples,
                       calibrated=model.calibrated, error=model.error, speed=self._speeds[rank],
                       kinds=self._accuracy[rank].describe(),
                       calibration=[step_row(s, self._calibrations[rank].predict(s))
                                    for s in self._calibration_steps[rank]])
