"""Reading a Prometheus text page: the sum of one metric's series whose labels include some."""

from __future__ import annotations

import re


def series_sum(page: str, name: str, **labels: str) -> float:
    """The sum of the series ``name`` on ``page`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", page, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total
