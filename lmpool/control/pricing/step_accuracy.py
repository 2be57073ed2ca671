"""How well a rank's priced step time predicts the steps it measures, by kind of step.

The pricing reads a rank's step time from one linear fit over every kind of step; a kind the
fit serves badly (a question's short prefill over a long cached prefix, a cascade's prefix
pass) shows here before it shows in the time-to-first-token predictions. Each timed step is
compared, as it is reported, with what the rank's priced coefficients predicted for it (those
the routes of its time used), and counted under its kind:

    decode   decoding rows only            cascade  decoding rows and a prefix pass (pairs)
    prefill  prompt chunks only            mixed    prompt chunks beside decoding rows

Per kind: the steps seen, and over the last ``HALF_LIFE`` or so of them (exponentially
decayed) the geometric mean of predicted / measured and the share within 25 %; and the last
``RECENT`` steps themselves, shape, time and prediction (a diagnosis's evidence).

Invariants: a kind's weights are > 0 once it has a step, its ratio finite and > 0 and its share
in [0, 1]; a step without a time or a prediction, or whose ratio is not finite, counts nowhere.
A rank's figures start afresh with its calibration (a restarted worker).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

from lmpool.protocol import StepKindFit, StepSample

KINDS = ("decode", "cascade", "prefill", "mixed")
HALF_LIFE = 500  # steps of one kind
WITHIN = 0.25  # the engine model's tolerance (the pool's time-to-first-token goal)
RECENT = 4  # steps of each kind kept whole


def kind_of(s: StepSample) -> str:
    if s.prefill_tokens:
        return "mixed" if s.decode_seqs else "prefill"
    # Attention pairs without a prompt token: a prefix pass as a sender from before ``cascade_pairs`` counted it.
    return "cascade" if s.cascade_pairs or s.attention else "decode"


class StepAccuracy:
    def __init__(self, half_life: float = HALF_LIFE) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.steps = dict.fromkeys(KINDS, 0)
        self._weight = dict.fromkeys(KINDS, 0.0)  # decayed sums: of 1, of log(predicted / measured), of within
        self._log = dict.fromkeys(KINDS, 0.0)
        self._within = dict.fromkeys(KINDS, 0.0)
        # (sample, predicted), newest last
        self._recent: dict[str, deque[tuple[StepSample, float]]] = {k: deque(maxlen=RECENT) for k in KINDS}

    def observe(self, samples: Iterable[StepSample], predict: Callable[[StepSample], float]) -> None:
        d = self.decay
        for s in samples:
            predicted = predict(s)
            ratio = predicted / s.seconds if 0 < s.seconds < math.inf else math.nan
            if not (0 < predicted < math.inf and 0 < ratio < math.inf):
                continue
            kind = kind_of(s)
            self.steps[kind] += 1
            self._weight[kind] = self._weight[kind] * d + 1.0
            self._log[kind] = self._log[kind] * d + math.log(ratio)
            self._within[kind] = self._within[kind] * d + (1 - WITHIN <= ratio <= 1 + WITHIN)
            self._recent[kind].append((s, predicted))

    def describe(self) -> list[StepKindFit]:
        """Each kind seen so far, in ``KINDS`` order."""
        return [StepKindFit(kind=k, steps=self.steps[k], within_25pct=self._within[k] / self._weight[k],
                            predicted_over_measured=math.exp(self._log[k] / self._weight[k]),
                            recent=[step_row(s, p) for s, p in self._recent[k]])
                for k in KINDS if self.steps[k]]


def step_row(s: StepSample, predicted: float) -> list[float]:
    """A step as ``StepKindFit.recent`` lists it: its seconds measured and predicted, then its shape."""
    return [s.seconds, predicted, s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context, s.cascade_pairs,
            s.prefill_keys]
