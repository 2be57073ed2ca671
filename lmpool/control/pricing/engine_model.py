"""The pool's engine model: one step-time fit per rank (``step_model``), fed by its workers.

A rank's fit starts from the prior, takes its worker's calibration steps when they arrive
(before the rank serves), then every step it reports. Replicas of one pool run one model
with one engine configuration, so they measure one thing: a rank that has not yet run
``FITTED`` steps of its own is priced by the mean of the ranks that have (by the mean of the
calibrations before any has). A few synthetic steps timed while the other workers calibrate
too are noisy, and an idle rank's calibration goes stale while its twins' fits follow the
machine as it is now; either alone would make an idle replica look dearer or cheaper than its
twin for the whole run. Each rank's own steps then move its fit where it really differs (a
replica on a busier GPU). A rank that restarts is a new engine state: its calibration resets
its fit. ``describe`` is what ``stats()`` and ``lmpool top`` show of a rank's fit.

Invariant: every rank has a fit at all times (the prior until some worker has reported).
"""

from __future__ import annotations

from lmpool.control.pricing.step_model import FITTED, StepCoefficients, StepModel
from lmpool.protocol import StepFit, StepTimings


def _mean(fits: list[StepCoefficients]) -> StepCoefficients:
    return StepCoefficients(*(sum(column) / len(fits) for column in zip(*fits)))


class EngineModel:
    def __init__(self, world_size: int) -> None:
        self.ranks = [StepModel() for _ in range(world_size)]
        self._calibrations: dict[int, StepCoefficients] = {}  # rank -> its calibration's fit
        self._pooled: StepCoefficients | None = None  # what a rank without steps of its own is priced by

    def observe(self, timings: StepTimings) -> None:
        model = self.ranks[timings.rank]
        if timings.calibration:
            self._calibrations[timings.rank] = model.calibrate(timings.samples)
        else:
            model.observe(timings.samples)
        fitted = [m.coefficients for m in self.ranks if m.samples >= FITTED]
        if fitted:
            self._pooled = _mean(fitted)
        elif self._calibrations:
            self._pooled = _mean(list(self._calibrations.values()))

    def coefficients(self, rank: int) -> StepCoefficients:
        model = self.ranks[rank]
        if model.samples >= FITTED or self._pooled is None:
            return model.coefficients
        return self._pooled

    def describe(self, rank: int) -> StepFit:
        model = self.ranks[rank]
        c = self.coefficients(rank)
        return StepFit(base_ms=c.base * 1e3, prefill_us_per_token=c.prefill_token * 1e6,
                       attention_ns_per_pair=c.attention_pair * 1e9, decode_us_per_seq=c.decode_seq * 1e6,
                       context_us_per_token=c.context_token * 1e6, samples=model.samples,
                       calibrated=model.calibrated, error=model.error)
