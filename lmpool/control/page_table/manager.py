"""The control plane's global page table: which rank holds which cached KV block, and how full each rank is.

Metadata only: every worker's ``BlockManager`` stays the authority over its own blocks; this
is a versioned replica of what the workers reported, plus the control plane's own bookkeeping.
One event loop owns it, so it takes no locks. ``GlobalBlockManager`` is the one object its
callers hold; each job's state and invariants live in their own module:

- ``ranks``: each rank's epoch, liveness, last report time and load;
- ``entries``: the entries and their ready index, applied from snapshots and deltas;
- ``in_flight``: blocks a transfer is bringing to a rank, not yet published;
- ``reservations``: capacity and queue work routes promised ranks;
- ``heat``: per-hash demand, decayed.

A report from a newer epoch is a restarted worker: the rank starts that epoch afresh, and
forgets its entries, markers and reservations, as it does when it dies. Invariants between
the jobs (``check_invariants``): only alive ranks hold entries, markers or reservations;
demand is tracked only for hashes some rank holds ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from lmpool.control.page_table.entries import EntryTable
from lmpool.control.page_table.heat import HashStats, Heat
from lmpool.control.page_table.in_flight import InFlight
from lmpool.control.page_table.ranks import RankInfo, RankRegistry, StaleUpdateError
from lmpool.control.page_table.reservations import Reservation, Reservations
from lmpool.engine.hashing import short
from lmpool.protocol import LoadReport, RankState
from lmpool.protocol.base import BlockHash
from lmpool.protocol.kv_events import KVDelta, KVSnapshot

__all__ = ["GlobalBlockManager", "PageEntry", "StaleUpdateError"]

DEFAULT_RESERVATION_TTL_S = 10.0
DEFAULT_HEAT_HALF_LIFE_S = 30.0
DEFAULT_ROUTE_HIT_WEIGHT = 0.5


class PageEntry(NamedTuple):
    rank: int
    block_id: int
    generation: int
    ready: bool


class GlobalBlockManager:
    def __init__(
        self,
        world_size: int,
        block_size: int,
        reservation_ttl_s: float = DEFAULT_RESERVATION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        heat_half_life_s: float = DEFAULT_HEAT_HALF_LIFE_S,
        route_hit_weight: float = DEFAULT_ROUTE_HIT_WEIGHT,
    ) -> None:
        if world_size < 1 or block_size < 1:
            raise ValueError(f"need world_size >= 1 and block_size >= 1, got {world_size}, {block_size}")
        if heat_half_life_s <= 0 or route_hit_weight < 0:
            raise ValueError(f"need heat_half_life_s > 0 and route_hit_weight >= 0, got {heat_half_life_s}, "
                             f"{route_hit_weight}")
        self.world_size = world_size
        self.block_size = block_size
        self.clock = clock
        self._heat = Heat(heat_half_life_s, route_hit_weight, clock)
        self._in_flight = InFlight(world_size)
        self._entries = EntryTable(world_size, self._in_flight, on_unheld=self._heat.forget)
        self._reservations = Reservations(world_size, reservation_ttl_s, clock)
        ranks = [RankInfo(r, self._entries.ranks[r], self._reservations.totals[r], self._in_flight.ranks[r])
                 for r in range(world_size)]
        self._registry = RankRegistry(ranks, clock)
        self.ranks = ranks
        self._on_load: Callable[[int], None] | None = None  # told each rank whose load report was applied

    @property
    def alive_mask(self) -> int:
        """Bit r set while rank r is registered and alive."""
        return self._registry.alive_mask

    @property
    def routable_mask(self) -> int:
        """Bit r set while rank r is alive and not silent (``mark_silent``): routing's ranks."""
        return self._registry.alive_mask & ~self._registry.silent_mask

    def mark_silent(self, timeout_s: float) -> list[int]:
        """Alive ranks that reported nothing, not even a heartbeat, for over ``timeout_s`` leave
        routing until they report again (a hung worker, or one whose control link is lost:
        their cache and load as last reported are stale); the ranks newly found silent."""
        return self._registry.mark_silent(timeout_s)

    @property
    def reservations(self) -> dict[str, Reservation]:
        return self._reservations.by_id

    @property
    def reservation_ttl_s(self) -> float:
        return self._reservations.ttl_s

    @property
    def snapshots_applied(self) -> int:
        return self._entries.snapshots_applied

    @property
    def deltas_applied(self) -> int:
        return self._entries.deltas_applied

    @property
    def gaps(self) -> int:
        return self._entries.gaps

    @property
    def stale_rejected(self) -> int:
        return self._registry.stale_rejected + self._entries.stale_rejected

    def watch_stored(self, callback: Callable[[int, BlockHash], None]) -> None:
        """Tell ``callback(rank, hash)`` of every block a rank reports."""
        self._entries.watch_stored(callback)

    def watch_removed(self, callback: Callable[[int, BlockHash], None]) -> None:
        """Tell ``callback(rank, hash)`` of every cached block a rank reports removed."""
        self._entries.watch_removed(callback)

    def watch_load(self, callback: Callable[[int], None]) -> None:
        """Tell ``callback(rank)`` of every load report, once it is applied (``update_load``)."""
        self._on_load = callback

    # ---- rank life cycle -------------------------------------------------------------

    def register_rank(self, rank: int, epoch: int, num_blocks: int) -> None:
        """A worker announced itself (at start, or with each snapshot). A newer epoch starts afresh."""
        info = self._registry.get(rank)
        self._registry.check_epoch(info, epoch)
        info.num_blocks = num_blocks
        if self._registry.is_new(info, epoch):
            self._restart(info, epoch)
        self._registry.heard(info)

    def mark_dead(self, rank: int) -> None:
        """Forget the rank's blocks, reservations and transfers; routing skips it until a newer epoch."""
        info = self._registry.get(rank)
        self._forget(rank)
        self._registry.mark_dead(info)

    def rank_up(self, rank: int, epoch: int) -> None:
        """The rank restarted as ``epoch``: its old entries are gone and it awaits a snapshot."""
        info = self._registry.get(rank)
        self._registry.check_epoch(info, epoch)
        if self._registry.is_new(info, epoch):
            self._restart(info, epoch)

    def _restart(self, info: RankInfo, epoch: int) -> None:
        self._forget(info.rank)
        self._registry.start(info, epoch)

    def _forget(self, rank: int) -> None:
        self._entries.forget(rank)
        self._reservations.drop_rank(rank)
        self._in_flight.clear(rank)

    def _accept(self, rank: int, epoch: int) -> RankInfo:
        """The rank's state for a worker report at ``epoch``, starting a newer epoch if it is one."""
        info = self._registry.get(rank)
        if not info.registered:
            raise ValueError(f"rank {rank} reported before it was registered")
        self._registry.check_epoch(info, epoch)
        if epoch > info.epoch:
            self._restart(info, epoch)
        self._registry.heard(info)
        return info

    # ---- worker reports ----------------------------------------------------------------

    def apply_snapshot(self, rank: int, epoch: int, snapshot: KVSnapshot) -> None:
        """Replace every entry of ``rank`` with the snapshot's blocks."""
        self._accept(rank, epoch)
        self._entries.apply_snapshot(rank, snapshot)

    def apply_delta(self, rank: int, epoch: int, delta: KVDelta) -> bool:
        """Apply the events if they continue the applied version; False on a gap (resync with a snapshot)."""
        self._accept(rank, epoch)
        return self._entries.apply_delta(rank, delta)

    def heartbeat(self, rank: int, epoch: int) -> None:
        """The rank is alive at ``epoch`` (a report without news): only its report time moves."""
        self._accept(rank, epoch)

    def update_load(self, rank: int, epoch: int, load: LoadReport) -> None:
        """Record the rank's queue and capacity; requests it admitted no longer need their reservations."""
        info = self._accept(rank, epoch)
        info.load = load
        self._reservations.release_admitted(rank, load.admitted)
        self._reservations.expire()
        if self._on_load is not None:
            self._on_load(rank)

    # ---- transfers: blocks not yet visible to routing ----------------------------------

    def mark_in_flight(self, rank: int, block_hash: BlockHash, block_id: int, generation: int) -> bool:
        """A transfer reserved block ``block_id`` on ``rank`` for ``block_hash``: routing must not count it.

        The entry stays not ready, whatever the worker reports meanwhile, until
        ``unmark_in_flight``. False (and nothing marked) when the rank already
        holds a ready copy: the transfer is redundant.
        """
        if not self._registry.get(rank).alive:
            raise ValueError(f"rank {rank} is not alive")
        return self._entries.mark_in_flight(rank, block_hash, generation << 32 | block_id)

    def unmark_in_flight(self, rank: int, block_hash: BlockHash, published: bool) -> None:
        """The transfer published the block (routing may use it now) or aborted (its reserved block is gone)."""
        self._registry.get(rank)  # a rank out of range raises
        self._entries.unmark_in_flight(rank, block_hash, published)

    # ---- routing reads -------------------------------------------------------------------

    def prefix_match(self, block_hashes: list[BlockHash], candidates: int | None = None) -> list[int]:
        """Per rank, how many leading blocks of ``block_hashes`` it holds ready, as one contiguous chain.

        Only alive ranks (and, if given, ranks in the ``candidates`` bitmask) count.
        """
        remaining = self.alive_mask if candidates is None else self.alive_mask & candidates
        return self._entries.prefix_match(block_hashes, remaining, self.world_size)

    def check_route(self, block_hashes: list[BlockHash], rank: int, matched: int) -> None:
        """The invariant on a routing decision: every one of the ``matched`` leading blocks
        counted for ``rank`` is published there (held and ready), never a block reserved
        for, or still arriving through, an open transfer."""
        info = self.ranks[rank]
        for i, h in enumerate(block_hashes[:matched]):
            assert h in info.blocks, f"route to rank {rank} counted block {i} ({short(h)}) it does not hold"
            assert h not in info.in_flight, (
                f"route to rank {rank} counted block {i} ({short(h)}), reserved for an unpublished transfer")

    def entries(self, block_hash: BlockHash) -> list[PageEntry]:
        """Every rank's entry for ``block_hash``, ready or not."""
        found = []
        for info in self.ranks:
            entry = info.blocks.get(block_hash)
            if entry is not None:
                ready = block_hash not in info.in_flight
                found.append(PageEntry(info.rank, entry & 0xFFFFFFFF, entry >> 32, ready))
        return found

    def generation(self, rank: int, block_hash: BlockHash) -> int | None:
        """The generation of ``rank``'s ready copy of ``block_hash`` (None without one)."""
        info = self.ranks[rank]
        entry = info.blocks.get(block_hash)
        if entry is None or block_hash in info.in_flight:
            return None
        return entry >> 32

    def ready_ranks(self, block_hash: BlockHash) -> int:
        """Bitmask of the alive ranks holding a ready copy of ``block_hash``."""
        return self._entries.ready.get(block_hash, 0)

    def record_route(self, block_hashes: list[BlockHash], held: int, used: int) -> None:
        """Demand seen at ingress: the first ``held`` blocks are cached somewhere; the route used the first ``used``."""
        self._heat.record_route(block_hashes, held, used)

    def hash_stats(self, block_hash: BlockHash) -> HashStats | None:
        return self._heat.stats.get(block_hash)

    def branched_depth(self, chain: list[BlockHash]) -> int:
        """How many leading blocks of ``chain`` routed prompts branched from (or after): up to and
        including its deepest ``HashStats.branched`` block; 0 when none is."""
        return self._heat.branched_depth(chain)

    def heat(self, block_hash: BlockHash) -> float:
        """The block's demand now: its accesses and route hits decayed to this instant (0 if never routed)."""
        return self._heat.heat(block_hash)

    # ---- route reservations ----------------------------------------------------------------

    def reserve(self, request_id: str, rank: int, blocks: int, tokens: int, attention: int = 0, context: int = 0,
                decode: int = 0, deferred: bool = False, cascade: int = 0, head: BlockHash | None = None,
                converted: int = 0, keys: int = 0) -> None:
        """Hold ``blocks`` of capacity and the request's queue work (``tokens`` to prefill, their
        ``attention`` pairs and the ``keys`` they read, its ``context``, ``decode`` tokens and
        ``cascade`` prefix) on ``rank`` until it admits it; ``deferred``: the request waits on a
        pull to ``rank`` (its work starts once that ends); ``head``: its cascade group's key
        (``group_key``), the group it joins there; ``converted``: the prefix a lone member of that
        group reads in the cascade once it joins."""
        if not self._registry.get(rank).alive:
            raise ValueError(f"cannot reserve on rank {rank}: it is not alive")
        self._reservations.reserve(request_id, rank, blocks, tokens, attention, context, decode, deferred, cascade,
                                   head, converted, keys)

    def admissible(self, request_id: str) -> None:
        """The pull the request waited on has ended: its reserved work is no longer deferred."""
        self._reservations.admissible(request_id)

    def release(self, request_id: str) -> bool:
        return self._reservations.release(request_id)

    def expire_reservations(self) -> int:
        """Release reservations older than the TTL (their request never reached its rank); how many."""
        return self._reservations.expire()

    # ---- reports ---------------------------------------------------------------------------

    def rank_state(self, rank: int) -> RankState:
        info = self._registry.get(rank)
        return RankState(
            rank=rank,
            alive=info.alive,
            epoch=info.epoch,
            snapshot_version=-1 if info.version is None else info.version,
            heartbeat_age_s=self.clock() - info.last_heartbeat if info.registered else -1.0,
            load=info.load,
            cached_blocks=info.num_ready,
        )

    def num_entries(self) -> int:
        return sum(len(info.blocks) for info in self.ranks)

    def check_invariants(self) -> None:
        """Each job's own invariants, and those between them (module docstring)."""
        self._registry.check()
        self._entries.check()
        self._reservations.check()
        for info in self.ranks:
            if info.blocks or info.in_flight:
                assert info.registered and info.alive, f"rank {info.rank} holds entries but is not alive"
        for request_id, reservation in self.reservations.items():
            assert self.ranks[reservation.rank].alive, f"reservation {request_id} on dead rank {reservation.rank}"
        assert self._heat.stats.keys() <= self._entries.ready.keys(), "stats kept for a hash no rank holds"
