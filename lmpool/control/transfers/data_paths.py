"""The workers' data paths, pair by pair: connected at start, connected again once one breaks.

A pair's path can break for good on its workers (a gloo wait past its timeout, a peer that
closed its end): every later transfer between the two then fails until both connect again
under a fresh session (``Connect``). A plan that fails on its data path
(``PhaseFailed.data_path``) marks its pair broken; the pair is connected again once no plan
between the two is open, since a new connection fails whatever the old one still carries.

Invariants: a pair is two distinct ranks, stored low rank first; a marked pair is connected
again once, then forgotten (a later failure marks it anew); a pair with a dead rank is forgotten.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from lmpool.protocol.transfer import Connect


class DataPaths:
    def __init__(self, send: Callable[[int, Connect], None], busy: Callable[[int, int], bool],
                 alive: Callable[[int], bool], session: Callable[[], int] = lambda: random.getrandbits(62)) -> None:
        """``send(rank, order)`` reaches a worker; ``busy(a, b)``: a plan between a and b is
        open; ``alive(rank)``: the rank is a live worker; ``session()``: a fresh session id."""
        self.send, self.busy, self.alive, self.session = send, busy, alive, session
        self.broken: set[tuple[int, int]] = set()
        self.reconnects = 0  # pairs connected again after a break

    def connect(self, a: int, b: int) -> None:
        """Open the path between ``a`` and ``b`` under a fresh session (both ends get it)."""
        session = self.session()
        self.send(a, Connect(b, session))
        self.send(b, Connect(a, session))

    def connect_all(self, ranks: Iterable[int]) -> None:
        ordered = sorted(ranks)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                self.connect(a, b)

    def mark_broken(self, a: int, b: int) -> None:
        """A plan between ``a`` and ``b`` failed on its data path: connect them again when idle."""
        if a != b:
            self.broken.add((min(a, b), max(a, b)))

    def settle(self) -> None:
        """Connect again every broken pair with no plan open between its ranks."""
        for a, b in sorted(self.broken):
            if not (self.alive(a) and self.alive(b)):
                self.broken.discard((a, b))  # a dead rank's pairs carry nothing more
            elif not self.busy(a, b):
                self.broken.discard((a, b))
                self.connect(a, b)
                self.reconnects += 1
