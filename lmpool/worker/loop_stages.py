"""How long a worker's step loop runs without yielding, per stage. While it runs, the worker's
readers wait: a request from the frontend (whose send waits once the link's ring is full) and a
transfer order from the control plane (a pull's first phase) are read only when it yields.

The stages are the loop's synchronous stretches: ``admit`` (the requests that arrived),
``launch`` (scheduling and launching a step) and ``read_back`` (reading back a step's tokens: the
awaited one, or one the device finished before the next launch), and, wherever they fall, the
garbage collector's passes (``collect``, once ``watch_collections`` is on: a full pass over a
heap holding torch takes a tenth of a second, which is why a worker freezes its start-up heap).
Per stage, since the worker started (or its pool reset): how many, their total and the longest, in milliseconds.

Invariants: every timed stretch counts once, under one stage; a stage's longest is at most its
total, and its total is zero when its count is.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STAGES = ("admit", "launch", "read_back", "collect")


class LoopStages:
    def __init__(self) -> None:
        self._count = dict.fromkeys(STAGES, 0)
        self._total = dict.fromkeys(STAGES, 0.0)
        self._longest = dict.fromkeys(STAGES, 0.0)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Count the body, which must not yield to the event loop, under ``stage``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - started)

    def watch_collections(self) -> Callable[[], None]:
        """Count every garbage collection of this process under ``collect`` from now on; the
        returned function stops that."""
        started = [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.add("collect", time.perf_counter() - started[0])

        gc.callbacks.append(timed)
        return lambda: gc.callbacks.remove(timed)

    def add(self, stage: str, seconds: float) -> None:
        if stage not in self._count:
            raise ValueError(f"unknown loop stage {stage!r}; the stages are {STAGES}")
        self._count[stage] += 1
        self._total[stage] += seconds
        self._longest[stage] = max(self._longest[stage], seconds)

    def clear(self) -> None:
        """Count from now on, as a new worker does (its pool reset)."""
        for stage in STAGES:
            self._count[stage], self._total[stage], self._longest[stage] = 0, 0.0, 0.0

    def snapshot(self) -> dict[str, list[float]]:
        """stage -> [count, total ms, longest ms]."""
        return {s: [self._count[s], round(self._total[s] * 1e3, 3), round(self._longest[s] * 1e3, 3)]
                for s in STAGES}
