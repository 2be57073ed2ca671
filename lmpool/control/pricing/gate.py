"""The bounded-load gate: whether a rank is overloaded against its pool (SGLang's model
gateway, smg 1.13, as its ``--help`` states its spill gate).

A rank is overloaded when its in-flight count exceeds the pool's mean by a margin and by a
ratio: ``load > mean + min(abs_threshold, max(4, 2 sqrt(mean)))`` and ``load > rel_threshold *
mean``. The margin is the natural swing of a count at that mean (two standard deviations of
a Poisson count, never under 4), capped at ``abs_threshold``: small imbalances, and the one
request that started a prefix's cold prefill, never pass it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def overloaded(load: float, loads: Iterable[float], abs_threshold: float, rel_threshold: float) -> bool:
    """Whether ``load`` (one of ``loads``, every candidate's) passes the gate."""
    loads = list(loads)
    mean = sum(loads) / len(loads)
    margin = min(abs_threshold, max(4.0, 2.0 * math.sqrt(mean)))
    return load > mean + margin and load > rel_threshold * mean
