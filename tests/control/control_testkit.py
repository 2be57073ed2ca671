"""Helpers of the control-plane tests: a clock the test moves by hand, and cached chains
written into a page table as worker snapshots."""

from __future__ import annotations

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import BlockStored, KVSnapshot


class ManualClock:
    """A clock that reads ``now``, which only the test changes."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def chain_blocks(hashes: list[int], first_id: int = 0, generation: int = 1) -> list[BlockStored]:
    """The chain ``hashes`` (root first) stored in consecutive block ids from ``first_id``."""
    parents = [ROOT_HASH] + hashes[:-1]
    return [BlockStored(h, p, first_id + i, generation) for i, (h, p) in enumerate(zip(hashes, parents))]


def cache(gbm: GlobalBlockManager, rank: int, hashes: list[int]) -> None:
    """Replace ``rank``'s cache with the chain ``hashes`` (a snapshot at the next version, epoch 1)."""
    gbm.apply_snapshot(rank, 1, KVSnapshot(gbm.ranks[rank].version + 1, chain_blocks(hashes)))
