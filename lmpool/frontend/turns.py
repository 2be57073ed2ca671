"""Turns at the event loop for CPU work that many tasks start at once (a burst's submissions).

One loop runs every request of a pool's client: a burst's submissions all become ready in one
loop round, and asyncio runs a round's ready tasks back to back before it looks at I/O again.
Each submission's work before its route (tokens, checks, block hashes) is a fraction of a
millisecond for a 4k-token prompt and a millisecond or more for a 16k one, so without turns the
route replies of a burst's first requests, and so their hand-over to a replica, wait behind
every later submission. ``Turns.take`` lets one task through per loop round: the others wait in
a queue, and each round's I/O (route replies, hand-overs, tokens) runs before the next turn.

A waiting task is woken once, when its turn comes: a burst of N submissions costs N wake-ups,
not one per waiting task per round (a queue that polled would spend a round's time on its own
waiters, and a burst's last submission would wait N rounds of N polls).

Invariants: at most one turn is taken per loop round; a task that finds no turn taken in its
round and nobody waiting does not wait; waiting tasks take their turns in the order they came,
one per round, each woken once; a waiting task that is cancelled leaves the queue, and one
cancelled once woken passes its turn on.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    def __init__(self) -> None:
        self._queue: deque[asyncio.Future[None]] = deque()
        self._taken = False  # a turn was taken this round; a callback of the next round clears it
        self.waits = 0  # tasks that waited for a later round

    async def take(self) -> None:
        """Return when this task may do its work: at once if no turn was taken in this loop round
        and nobody waits, else in a later round, after those that came first."""
        loop = asyncio.get_running_loop()
        if not self._taken and not self._queue:
            self._start_turn(loop)
            return
        waiter: asyncio.Future[None] = loop.create_future()
        self._queue.append(waiter)
        self.waits += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # woken, then cancelled: its round is spent
                self._start_turn(loop)
            elif waiter in self._queue:  # a round's end may have dropped it already
                self._queue.remove(waiter)
            raise
        self._start_turn(loop)

    def _start_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """A turn is taken in this round; the next round (a callback scheduled now, so after this
        round's other callbacks and the next round's I/O) ends it and wakes the next waiter."""
        self._taken = True
        loop.call_soon(self._end_turn)

    def _end_turn(self) -> None:
        self._taken = False
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._taken = True  # held for the woken task, which runs next round
                return
