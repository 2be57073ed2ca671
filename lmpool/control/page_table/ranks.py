"""The rank registry: each rank's incarnation (epoch), liveness, last report time and load.

Invariants: bit r of ``alive_mask`` is set exactly while rank r is registered and alive; a
rank's epoch never decreases; a report from an older epoch, or from the epoch declared dead,
raises ``StaleUpdateError`` and is counted in ``stale_rejected``. Bit r of ``silent_mask`` is
set only while rank r is alive and has not been heard from since ``mark_silent`` found it silent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lmpool.protocol import LoadReport
from lmpool.protocol.base import BlockHash

if TYPE_CHECKING:
    from lmpool.control.page_table.entries import RankEntries
    from lmpool.control.page_table.reservations import RankReservations


class StaleUpdateError(Exception):
    """A report from an older epoch (or a dead incarnation), or a snapshot older than the one applied."""


class RankInfo:
    """One rank as routing and transfers read it: the registry's fields, and read-only
    access to the rank's entries, reservations and in-flight markers (owned elsewhere)."""

    __slots__ = ("rank", "registered", "alive", "epoch", "last_heartbeat", "num_blocks", "load",
                 "entries", "reserved", "in_flight")

    def __init__(self, rank: int, entries: RankEntries, reserved: RankReservations,
                 in_flight: dict[BlockHash, int]) -> None:
        self.rank = rank
        self.registered = False
        self.alive = False
        self.epoch = -1
        self.last_heartbeat = 0.0
        self.num_blocks = 0
        self.load = LoadReport()
        self.entries = entries
        self.reserved = reserved
        self.in_flight = in_flight  # hash -> the block a transfer reserved for it (packed), not yet published

    @property
    def version(self) -> int | None:
        """The snapshot version applied so far; None awaits a snapshot."""
        return self.entries.version

    @property
    def blocks(self) -> dict[BlockHash, int]:
        return self.entries.blocks

    @property
    def num_ready(self) -> int:
        return self.entries.num_ready

    @property
    def num_entries(self) -> int:
        """Entries held here, ready or not."""
        return len(self.entries.blocks)

    @property
    def reserved_blocks(self) -> int:
        return self.reserved.blocks

    @property
    def reserved_tokens(self) -> int:
        return self.reserved.tokens

    @property
    def num_reservations(self) -> int:
        return self.reserved.count

    @property
    def in_flight_seqs(self) -> int:
        """Requests here: running and waiting as last reported, and routed but not admitted yet."""
        return self.load.num_running + self.load.num_waiting + self.reserved.count

    @property
    def blocks_available(self) -> int:
        """Blocks a new request could still get here: free + reclaimable as last reported, minus reservations."""
        return self.load.blocks_free + self.load.blocks_reclaimable - self.reserved.blocks


class RankRegistry:
    def __init__(self, ranks: list[RankInfo], clock: Callable[[], float]) -> None:
        self.ranks = ranks
        self.clock = clock
        self.alive_mask = 0
        self.silent_mask = 0
        self.stale_rejected = 0

    def get(self, rank: int) -> RankInfo:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is out of range for world_size {len(self.ranks)}")
        return self.ranks[rank]

    def check_epoch(self, info: RankInfo, epoch: int) -> None:
        """Raise for a report from an older incarnation, or from the incarnation already declared dead."""
        if epoch < 0:
            raise ValueError(f"rank {info.rank}: epoch must be >= 0, got {epoch}")
        if not info.registered:
            return
        if epoch < info.epoch or (epoch == info.epoch and not info.alive):
            self.stale_rejected += 1
            state = "alive" if info.alive else "dead"
            raise StaleUpdateError(f"rank {info.rank}: epoch {epoch} is stale (rank is at epoch {info.epoch}, {state})")

    def is_new(self, info: RankInfo, epoch: int) -> bool:
        """Whether ``epoch`` (already checked) starts a new incarnation of the rank."""
        return not info.registered or epoch > info.epoch

    def start(self, info: RankInfo, epoch: int) -> None:
        """Incarnation ``epoch`` of the rank is alive, with a fresh load (all its blocks free)."""
        info.registered = True
        info.alive = True
        info.epoch = epoch
        info.load = LoadReport(blocks_free=info.num_blocks)
        self.heard(info)
        self.alive_mask |= 1 << info.rank

    def heard(self, info: RankInfo) -> None:
        """The rank reported (anything): it is not silent."""
        info.last_heartbeat = self.clock()
        self.silent_mask &= ~(1 << info.rank)

    def mark_silent(self, timeout_s: float) -> list[int]:
        """Alive ranks not heard from for over ``timeout_s``: the ones newly found silent."""
        now, newly = self.clock(), []
        for info in self.ranks:
            bit = 1 << info.rank
            if info.alive and not self.silent_mask & bit and now - info.last_heartbeat > timeout_s:
                self.silent_mask |= bit
                newly.append(info.rank)
        return newly

    def mark_dead(self, info: RankInfo) -> None:
        info.alive = False
        self.alive_mask &= ~(1 << info.rank)
        self.silent_mask &= ~(1 << info.rank)

    def check(self) -> None:
        for info in self.ranks:
            assert bool(self.alive_mask >> info.rank & 1) == (info.registered and info.alive), "alive mask"
            assert not self.silent_mask >> info.rank & 1 or info.alive, "a silent rank is alive"
