"""How long each phase of a replica's start took, in seconds, in the order they ran (the engine's
kernels, weights, KV cache, attention plans, CUDA graphs, warm-up; a pool's worker adds its
calibration and its own set-up): what a pool start spends, phase by phase, in ``stats()``.

Invariant: the phases cover the time from the first mark to the latest, once each."""

from __future__ import annotations

import time


class StartPhases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the previous lap (or the start) goes to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
