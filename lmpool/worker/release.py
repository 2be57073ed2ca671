"""A worker's side of foreground release: when admission would evict cached blocks, ask the
control plane to move them to a partner first, and wait a bounded time.

``on_shortage`` is the scheduler's hook (``Scheduler.on_shortage``). States:

    IDLE --shortage, victims found, not cooling down--> PENDING (report queued in ``outbox``)
    PENDING --outcome "done"--> IDLE
    PENDING --outcome "refused"/"aborted", or ``wait_s`` passed--> IDLE, cooling ``retry_s``

While PENDING the hook answers True (keep the sequence waiting) and admission waits
for the move; at any other time it answers False and admission evicts as it
always did. After a refusal or failure the very next shortage evicts whatever
``retry_s`` is (the admission that waited goes ahead, so it can never be asked
about twice in a row), and later ones evict without asking until ``retry_s`` has
passed. So a release never holds admission longer than ``wait_s``: no outcome, a
lost message or a dead control process ends in eviction, never in a stall.

The victims are the blocks eviction would take next (``BlockManager.eviction_order``):
cached, unreferenced, leaves first, never the waiting sequence's own prefix hit; live
blocks are never named. The report carries their cached ancestors too, parents
first, so the partner can hold them as a chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol import ReleaseOutcome, ShortageReport
from lmpool.protocol.base import BlockHash


class ForegroundRelease:
    def __init__(
        self, bm: BlockManager, rank: int, epoch: int, wait_s: float, retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bm = bm
        self.rank = rank
        self.epoch = epoch
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.clock = clock
        self.outbox: list[ShortageReport] = []  # reports for the control plane, sent by the worker
        self.pending: int | None = None  # the release id awaiting its outcome
        self.deadline = 0.0
        self.retry_at = 0.0
        self.connected = True  # False while no control plane is attached: nobody to ask
        self._ids = 0
        self.evict_next = False  # the shortage after a refusal or failure evicts
        self.requested = self.moved = self.fell_back = 0

    def __call__(self, hit: list[int], num_blocks: int) -> bool:
        """The scheduler's shortage hook (``Scheduler.on_shortage``)."""
        return self.on_shortage(hit, num_blocks)

    def on_shortage(self, hit: list[int], num_blocks: int) -> bool:
        """Admission needs ``num_blocks`` cached blocks evicted: True to wait for a move instead."""
        now = self.clock()
        if self.pending is not None:
            if now < self.deadline:
                return True
            self._give_up(now)  # no answer in time: this very admission evicts
            self.evict_next = False
            return False
        if self.evict_next or now < self.retry_at or not self.connected:
            self.evict_next = False
            return False
        report = self.report(hit, num_blocks)
        if report is None:
            return False
        self.outbox.append(report)
        self.pending = report.release_id
        self.deadline = now + self.wait_s
        self.requested += 1
        return True

    def on_outcome(self, outcome: ReleaseOutcome) -> None:
        if outcome.release_id != self.pending:
            return  # an answer that came after this worker gave up on it
        self.pending = None
        if outcome.state == "done":
            self.moved += 1
        else:
            self._give_up(self.clock())

    def disconnected(self) -> None:
        """The control plane is gone: no outcome will come, so a pending release ends now."""
        self.connected = False
        if self.pending is not None:
            self._give_up(self.clock())

    def _give_up(self, now: float) -> None:
        self.pending = None
        self.evict_next = True
        self.retry_at = now + self.retry_s
        self.fell_back += 1

    def report(self, hit: list[int], num_blocks: int) -> ShortageReport | None:
        """The shortage report for the ``num_blocks`` blocks eviction would take (None if none)."""
        bm = self.bm
        victims = bm.eviction_order(num_blocks, exclude=hit)
        if not victims:
            return None
        chosen = set(victims)
        ancestors = set()
        for block_id in victims:
            parent = bm.blocks[block_id].parent_id
            while parent is not None and parent not in chosen and parent not in ancestors:
                ancestors.add(parent)
                parent = bm.blocks[parent].parent_id
        order = sorted(ancestors, key=self._depth) + sorted(victims, key=self._depth)
        self._ids += 1
        blocks = [bm.blocks[b] for b in order]
        return ShortageReport(
            self.rank, self.epoch, self._ids,
            # Eviction takes cached blocks, and a cached block's parent is cached: every hash is set.
            hashes=cast(list[BlockHash], [b.block_hash for b in blocks]),
            parents=cast(list[BlockHash], [bm.blocks[b.parent_id].block_hash if b.parent_id is not None else ROOT_HASH
                                           for b in blocks]),
            generations=[b.generation for b in blocks],
            num_victims=len(victims),
            expected_reuses=sum(bm.blocks[b].hits for b in victims) / len(victims),
        )

    def _depth(self, block_id: int) -> int:
        depth, parent = 0, self.bm.blocks[block_id].parent_id
        while parent is not None:
            depth, parent = depth + 1, self.bm.blocks[parent].parent_id
        return depth
