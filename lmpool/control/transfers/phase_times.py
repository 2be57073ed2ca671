"""How long transfer plans take to pass each phase, per kind of plan ("pull", "background" ...).

For each of the last ``keep`` plans of a kind that reached DONE, the seconds from its start to
the end of each phase (``PHASES``: both sides prepared, both executed (over CUDA IPC the
destination), the destination published, the source finalized), and when each side's
prepare answer arrived (``SIDES``: which of the two the first phase waited for) and how long
each side's order waited on its worker between its reader taking it and the step loop acting
on it (``HELD``; the rest of a side's time is the links and a loop too busy to read). ``summary``
gives, per kind and entry, the median and the largest of them in milliseconds and how many plans
they cover: where a copy's time goes, which its estimate alone does not say.

Invariants: at most ``keep`` plans per kind; a plan's phase times are non-decreasing and one per
phase; each side's prepare answer came by the end of the first phase.
"""

from __future__ import annotations

from collections import deque

import numpy as np

PHASES = ("prepared", "executed", "published", "finalized")
SIDES = ("source_prepared", "dest_prepared")
HELD = ("source_held", "dest_held")


class PhaseTimes:
    def __init__(self, keep: int = 256) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._by_kind: dict[str, deque[tuple[float, ...]]] = {}

    def record(self, kind: str, times: list[float], sides: tuple[float, float],
               held: tuple[float, float] = (0.0, 0.0)) -> None:
        """A plan of ``kind`` ended DONE, each phase ending ``times[i]`` seconds after its start,
        the source's and the destination's prepare answers arriving ``sides`` seconds after it,
        their orders having waited ``held`` seconds on their workers (measured there)."""
        if len(times) != len(PHASES) or any(b < a for a, b in zip(times, times[1:])):
            raise ValueError(f"a plan's phase times are {len(PHASES)} non-decreasing seconds, got {times}")
        if max(sides) > times[0]:
            raise ValueError(f"a side's prepare answer ({sides}) came after the phase ended ({times[0]})")
        self._by_kind.setdefault(kind, deque(maxlen=self.keep)).append((*times, *sides, *held))

    def summary(self) -> dict[str, dict[str, list[float]]]:
        """kind -> phase or side -> [median ms, max ms, plans]."""
        out = {}
        for kind, plans in self._by_kind.items():
            ms = np.asarray(plans) * 1e3
            out[kind] = {name: [round(float(np.median(ms[:, i])), 3), round(float(ms[:, i].max()), 3), len(plans)]
                         for i, name in enumerate(PHASES + SIDES + HELD)}
        return out
