"""Turns at the event loop for CPU work that many tasks start at once (a burst's submissions).

One loop runs every request of a pool's client: a burst's submissions all become ready in one
loop round, and asyncio runs a round's ready tasks back to back before it looks at I/O again.
Each submission's work before its route (tokens, checks, block hashes) is a fraction of a
millisecond for a 4k-token prompt and several for a 32k one, so without turns the route replies
of a burst's first requests, and so their hand-over to a replica, wait behind every later
submission. ``Turns.take`` bounds that: once a round has spent ``budget_s`` in turns, a task
waits for a later round, and the loop's I/O comes first.

Invariants: a task that takes a turn in a round whose spent time is under the budget never
waits; one that waits is let through in a later round, in the order the waiting tasks yielded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

BUDGET_S = 1e-3  # a round's turns, at most (plus the last one's work)


class Turns:
    def __init__(self, budget_s: float = BUDGET_S, clock: Callable[[], float] = time.perf_counter) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.budget_s = budget_s
        self.clock = clock
        self._round = 0  # counts rounds opened
        self._round_start = -float("inf")  # when the current round's turns began
        self.waits = 0  # turns that waited for a later round

    async def take(self) -> None:
        """Return when this loop round has room for one more turn's work."""
        while self.clock() - self._round_start > self.budget_s:
            seen = self._round
            self.waits += 1
            await asyncio.sleep(0)  # a round later, after the loop's I/O
            if self._round == seen:  # the first task back opens the new round
                self._round += 1
                self._round_start = self.clock()
