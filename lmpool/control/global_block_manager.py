"""The control plane's global page table: which rank holds which cached KV block, and how full each rank is.

Metadata only: every worker's ``BlockManager`` stays the authority over its own
blocks; this is a versioned replica of what the workers reported, plus the
control plane's own bookkeeping (route reservations, transfer in-flight markers,
per-hash demand). One event loop owns it, so it takes no locks.

The page table maps ``hash -> entries [(rank, block_id, generation, ready)]``.
It is stored per rank as ``hash -> generation << 32 | block_id`` (one int per
entry, block ids below 2**32: a million entries cost no tuples and give the
garbage collector nothing to trace) with one routing index on top: ``hash -> bitmask of the ranks
holding a ready copy``. An entry is ready unless a transfer marked its hash in
flight on that rank (reserved or received, not yet published:
``mark_in_flight``); routing never counts such a block.

Per-rank state follows the worker's life: an epoch (one per process
incarnation), the snapshot version applied so far (None until the first
snapshot), the latest ``LoadReport``, and the last time it reported.

Update rules:
- An epoch lower than the rank's, or a dead rank's own epoch, is stale: the
  update raises ``StaleUpdateError`` and is counted.
- A snapshot replaces the rank's entries wholesale; one at the current epoch
  with a version lower than the applied one is stale. A snapshot, or any
  report, at a newer epoch is a restarted worker: it starts that epoch afresh.
- A delta applies only if its ``from_version`` equals the applied version;
  otherwise it is a gap, ``apply_delta`` returns False and the caller asks the
  worker for a snapshot (``ResyncRequest``).

Invariants (``check_invariants``): every entry belongs to a registered, alive
rank; the ready index holds exactly the ready entries; per-rank ready counts
match the entries; every reservation is on an alive rank and the
per-rank reservation totals are the sums of its reservations; per-hash stats
exist only for hashes some rank holds; in-flight markers are on alive ranks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from lmpool.engine.hashing import short
from lmpool.engine.kv_events import BlockStored, KVDelta, KVSnapshot
from lmpool.pool.messages import LoadReport, RankState

DEFAULT_RESERVATION_TTL_S = 10.0
DEFAULT_HEAT_HALF_LIFE_S = 30.0
DEFAULT_ROUTE_HIT_WEIGHT = 0.5


class StaleUpdateError(Exception):
    """A report from an older epoch (or a dead incarnation), or a snapshot older than the one applied."""


class PageEntry(NamedTuple):
    rank: int
    block_id: int
    generation: int
    ready: bool


class Reservation(NamedTuple):
    """Capacity and queue work a route promised a rank before the rank's own reports show it."""

    request_id: str
    rank: int
    blocks: int
    tokens: int
    created: float


class HashStats(msgspec.Struct, gc=False):
    """Demand for one cached block: how often routed prompts contained it, how often a route
    used it, and its heat: those two decayed with the page table's half-life (an access
    counts 1, a route hit ``route_hit_weight`` more). ``heat`` is kept scaled by
    ``2 ** (t / half_life)`` from its ``epoch``'s base time, so that a route adds to it
    without computing any decay (``GlobalBlockManager.heat`` reads it).

    Untracked by the garbage collector (it holds numbers only): hundreds of
    thousands of these would otherwise make every full collection pause the
    control loop for tens of milliseconds.
    """

    accesses: int = 0
    route_hits: int = 0
    last_access: float = 0.0
    heat: float = 0.0
    epoch: int = 0


class RankInfo:
    __slots__ = (
        "rank", "registered", "alive", "epoch", "version", "last_heartbeat", "num_blocks", "load",
        "blocks", "num_ready", "reserved_blocks", "reserved_tokens", "num_reservations", "in_flight",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.registered = False
        self.alive = False
        self.epoch = -1
        self.version: int | None = None  # snapshot version applied so far; None awaits a snapshot
        self.last_heartbeat = 0.0
        self.num_blocks = 0
        self.load = LoadReport()
        self.blocks: dict[int, int] = {}  # hash -> generation << 32 | block_id
        self.num_ready = 0
        self.reserved_blocks = 0
        self.reserved_tokens = 0
        self.num_reservations = 0
        # Hashes a transfer is bringing here, not yet published -> the block it reserved (packed).
        self.in_flight: dict[int, int] = {}

    @property
    def blocks_available(self) -> int:
        """Blocks a new request could still get here: free + reclaimable as last reported, minus reservations."""
        return self.load.blocks_free + self.load.blocks_reclaimable - self.reserved_blocks


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
        self.reservation_ttl_s = reservation_ttl_s
        self.heat_half_life_s = heat_half_life_s
        # Heat scaling: times are measured in half-lives from a base that moves (a new epoch)
        # before 2 ** x could overflow; an entry from an older epoch is rescaled when next met.
        self._heat_bases = [clock()]
        self.route_hit_weight = route_hit_weight
        self.clock = clock
        self.ranks = [RankInfo(r) for r in range(world_size)]
        self.alive_mask = 0  # bit r set while rank r is registered and alive
        self._ready: dict[int, int] = {}  # hash -> bitmask of ranks holding a ready copy
        self._stats: dict[int, HashStats] = {}
        self.reservations: dict[str, Reservation] = {}
        # Reservations in creation order, for TTL expiry without a scan; released ones are
        # skipped when they reach the front.
        self._expiry: deque[tuple[float, str]] = deque()
        # Told (rank, hash) whenever a rank reports a block: routing's pending prefixes end
        # there (``lmpool.control.pending``), the page table knowing better from then on.
        self.on_stored: Callable[[int, int], None] | None = None
        self.snapshots_applied = 0
        self.deltas_applied = 0
        self.gaps = 0
        self.stale_rejected = 0

    # ---- rank life cycle -------------------------------------------------------------

    def register_rank(self, rank: int, epoch: int, num_blocks: int) -> None:
        """A worker announced itself (at start, or with each snapshot). A newer epoch starts afresh."""
        info = self._rank(rank)
        self._check_epoch(info, epoch)
        info.num_blocks = num_blocks
        if not info.registered or epoch > info.epoch:
            self._reset(info, epoch)
        info.last_heartbeat = self.clock()

    def mark_dead(self, rank: int) -> None:
        """Forget the rank's blocks, reservations and transfers; routing skips it until a newer epoch."""
        info = self._rank(rank)
        self._forget(info)
        info.alive = False
        self.alive_mask &= ~(1 << rank)

    def rank_up(self, rank: int, epoch: int) -> None:
        """The rank restarted as ``epoch``: its old entries are gone and it awaits a snapshot."""
        info = self._rank(rank)
        self._check_epoch(info, epoch)
        if not info.registered or epoch > info.epoch:
            self._reset(info, epoch)

    def _reset(self, info: RankInfo, epoch: int) -> None:
        """Start incarnation ``epoch`` of the rank: alive, empty, awaiting its snapshot and first report."""
        self._forget(info)
        info.registered = True
        info.alive = True
        info.epoch = epoch
        info.load = LoadReport(blocks_free=info.num_blocks)
        info.last_heartbeat = self.clock()
        self.alive_mask |= 1 << info.rank

    def _forget(self, info: RankInfo) -> None:
        self._drop_entries(info)
        self._drop_reservations(info)
        info.in_flight.clear()
        info.version = None

    def _check_epoch(self, info: RankInfo, epoch: int) -> None:
        """Raise for a report from an older incarnation, or from the incarnation already declared dead."""
        if epoch < 0:
            raise ValueError(f"rank {info.rank}: epoch must be >= 0, got {epoch}")
        if not info.registered:
            return
        if epoch < info.epoch or (epoch == info.epoch and not info.alive):
            self.stale_rejected += 1
            state = "alive" if info.alive else "dead"
            raise StaleUpdateError(f"rank {info.rank}: epoch {epoch} is stale (rank is at epoch {info.epoch}, {state})")

    def _accept(self, rank: int, epoch: int) -> RankInfo:
        """The rank's state for a worker report at ``epoch``, starting a newer epoch if it is one."""
        info = self._rank(rank)
        if not info.registered:
            raise ValueError(f"rank {rank} reported before it was registered")
        self._check_epoch(info, epoch)
        if epoch > info.epoch:
            self._reset(info, epoch)
        info.last_heartbeat = self.clock()
        return info

    def _rank(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {self.world_size}")
        return self.ranks[rank]

    # ---- worker reports ----------------------------------------------------------------

    def apply_snapshot(self, rank: int, epoch: int, snapshot: KVSnapshot) -> None:
        """Replace every entry of ``rank`` with the snapshot's blocks."""
        info = self._accept(rank, epoch)
        if info.version is not None and snapshot.version < info.version:
            self.stale_rejected += 1
            raise StaleUpdateError(
                f"rank {rank}: snapshot version {snapshot.version} is older than the applied {info.version}"
            )
        self._drop_entries(info)
        for stored in snapshot.blocks:
            self._store(info, stored)
        info.version = snapshot.version
        self.snapshots_applied += 1

    def apply_delta(self, rank: int, epoch: int, delta: KVDelta) -> bool:
        """Apply the events if they continue the applied version; False on a gap (resync with a snapshot)."""
        info = self._accept(rank, epoch)
        if delta.to_version - delta.from_version != len(delta.events):
            raise ValueError(
                f"rank {rank}: delta {delta.from_version}->{delta.to_version} carries {len(delta.events)} events"
            )
        if info.version is None or delta.from_version != info.version:
            self.gaps += 1
            return False
        for event in delta.events:
            if type(event) is BlockStored:
                self._store(info, event)
            else:
                self._remove(info, event.block_hash, event.block_id, event.generation)
        info.version = delta.to_version
        self.deltas_applied += 1
        return True

    def heartbeat(self, rank: int, epoch: int) -> None:
        """The rank is alive at ``epoch`` (a report without news): only its report time moves."""
        self._accept(rank, epoch)

    def update_load(self, rank: int, epoch: int, load: LoadReport) -> None:
        """Record the rank's queue and capacity; requests it admitted no longer need their reservations."""
        info = self._accept(rank, epoch)
        info.load = load
        for request_id in load.admitted:
            reservation = self.reservations.get(request_id)
            if reservation is not None and reservation.rank == rank:
                self.release(request_id)
        self.expire_reservations()

    def _store(self, info: RankInfo, stored: BlockStored) -> None:
        h = stored.block_hash
        blocks = info.blocks
        known = h in blocks
        blocks[h] = stored.generation << 32 | stored.block_id
        if not known and h not in info.in_flight:
            self._set_ready(info, h, True)
        if self.on_stored is not None:
            self.on_stored(info.rank, h)

    def _remove(self, info: RankInfo, h: int, block_id: int, generation: int) -> None:
        # A removal of another copy (an older generation, or a transfer's reserved block) is not this entry's.
        if info.blocks.get(h) != generation << 32 | block_id:
            return
        del info.blocks[h]
        if h not in info.in_flight:
            self._set_ready(info, h, False)

    def _set_ready(self, info: RankInfo, h: int, ready: bool) -> None:
        """Add or remove rank ``info``'s bit of ``h`` in the ready index (only called on a change)."""
        bit = 1 << info.rank
        if ready:
            self._ready[h] = self._ready.get(h, 0) | bit
            info.num_ready += 1
            return
        mask = self._ready.get(h, 0) & ~bit
        if mask:
            self._ready[h] = mask
        else:
            self._ready.pop(h, None)
            self._stats.pop(h, None)  # demand is tracked only for blocks some rank can serve
        info.num_ready -= 1

    def _drop_entries(self, info: RankInfo) -> None:
        for h in info.blocks:
            if h not in info.in_flight:
                self._set_ready(info, h, False)
        info.blocks = {}
        assert info.num_ready == 0

    # ---- transfers: blocks not yet visible to routing ----------------------------------

    def mark_in_flight(self, rank: int, block_hash: int, block_id: int, generation: int) -> bool:
        """A transfer reserved block ``block_id`` on ``rank`` for ``block_hash``: routing must not count it.

        The entry stays not ready, whatever the worker reports meanwhile, until
        ``unmark_in_flight``. False (and nothing marked) when the rank already
        holds a ready copy: the transfer is redundant.
        """
        info = self._rank(rank)
        if not info.alive:
            raise ValueError(f"rank {rank} is not alive")
        if block_hash in info.blocks and block_hash not in info.in_flight:
            return False
        reserved = generation << 32 | block_id
        info.in_flight[block_hash] = reserved
        info.blocks.setdefault(block_hash, reserved)
        return True

    def unmark_in_flight(self, rank: int, block_hash: int, published: bool) -> None:
        """The transfer published the block (routing may use it now) or aborted (its reserved block is gone)."""
        info = self._rank(rank)
        reserved = info.in_flight.pop(block_hash, None)
        if reserved is None:
            return
        entry = info.blocks.get(block_hash)
        if entry is None:
            return  # a snapshot or removal dropped it meanwhile
        if published or entry != reserved:  # an abort leaves a copy the worker cached on its own
            self._set_ready(info, block_hash, True)
        else:
            del info.blocks[block_hash]

    # ---- routing reads -------------------------------------------------------------------

    def prefix_match(self, block_hashes: list[int], candidates: int | None = None) -> list[int]:
        """Per rank, how many leading blocks of ``block_hashes`` it holds ready, as one contiguous chain.

        Only alive ranks (and, if given, ranks in the ``candidates`` bitmask) count.
        The walk keeps the set of ranks still matching as a bitmask and stops as
        soon as it is empty, so a miss costs one dict lookup.
        """
        lengths = [0] * self.world_size
        remaining = self.alive_mask if candidates is None else self.alive_mask & candidates
        get = self._ready.get
        n = 0
        for h in block_hashes:
            mask = get(h, 0) & remaining
            if mask != remaining:
                dropped = remaining & ~mask
                while dropped:
                    low = dropped & -dropped
                    lengths[low.bit_length() - 1] = n
                    dropped ^= low
                remaining = mask
                if not remaining:
                    return lengths
            n += 1
        while remaining:
            low = remaining & -remaining
            lengths[low.bit_length() - 1] = n
            remaining ^= low
        return lengths

    def check_route(self, block_hashes: list[int], rank: int, matched: int) -> None:
        """The invariant on a routing decision: every one of the ``matched`` leading blocks
        counted for ``rank`` is published there (held and ready), never a block reserved
        for, or still arriving through, an open transfer."""
        info = self.ranks[rank]
        for i, h in enumerate(block_hashes[:matched]):
            assert h in info.blocks, f"route to rank {rank} counted block {i} ({short(h)}) it does not hold"
            assert h not in info.in_flight, (
                f"route to rank {rank} counted block {i} ({short(h)}), reserved for an unpublished transfer")

    def entries(self, block_hash: int) -> list[PageEntry]:
        """Every rank's entry for ``block_hash``, ready or not."""
        found = []
        for info in self.ranks:
            entry = info.blocks.get(block_hash)
            if entry is not None:
                ready = block_hash not in info.in_flight
                found.append(PageEntry(info.rank, entry & 0xFFFFFFFF, entry >> 32, ready))
        return found

    def generation(self, rank: int, block_hash: int) -> int | None:
        """The generation of ``rank``'s ready copy of ``block_hash`` (None without one)."""
        info = self.ranks[rank]
        entry = info.blocks.get(block_hash)
        if entry is None or block_hash in info.in_flight:
            return None
        return entry >> 32

    def ready_ranks(self, block_hash: int) -> int:
        """Bitmask of the alive ranks holding a ready copy of ``block_hash``."""
        return self._ready.get(block_hash, 0)

    def record_route(self, block_hashes: list[int], held: int, used: int) -> None:
        """Demand seen at ingress: the first ``held`` blocks are cached somewhere; the route used the first ``used``."""
        now = self.clock()
        stats = self._stats
        epoch, scale = self._heat_scale(now)
        access, hit = scale, scale * (1.0 + self.route_hit_weight)
        for i in range(held):
            h = block_hashes[i]
            s = stats.get(h)
            if s is None:
                s = stats[h] = HashStats(epoch=epoch)
            elif s.epoch != epoch:
                self._rebase(s, epoch)
            s.accesses += 1
            s.last_access = now
            if i < used:
                s.route_hits += 1
                s.heat += hit
            else:
                s.heat += access

    def _heat_scale(self, now: float) -> tuple[int, float]:
        """The current heat epoch and ``2 ** (half-lives since its base)``, starting a new epoch
        when that grows large (a rare event: every few hundred half-lives)."""
        bases = self._heat_bases
        x = (now - bases[-1]) / self.heat_half_life_s
        if x > 256:
            bases.append(now)
            x = 0.0
        return len(bases) - 1, 2.0 ** x

    def _rebase(self, s: HashStats, epoch: int) -> None:
        s.heat *= 2.0 ** ((self._heat_bases[s.epoch] - self._heat_bases[epoch]) / self.heat_half_life_s)
        s.epoch = epoch

    def hash_stats(self, block_hash: int) -> HashStats | None:
        return self._stats.get(block_hash)

    def heat(self, block_hash: int) -> float:
        """The block's demand now: its accesses and route hits decayed to this instant (0 if
        never routed)."""
        s = self._stats.get(block_hash)
        if s is None:
            return 0.0
        epoch, scale = self._heat_scale(self.clock())
        if s.epoch != epoch:
            self._rebase(s, epoch)
        return s.heat / scale

    # ---- route reservations ----------------------------------------------------------------

    def reserve(self, request_id: str, rank: int, blocks: int, tokens: int) -> None:
        """Hold ``blocks`` of capacity and ``tokens`` of queue work on ``rank`` until it admits the request."""
        info = self._rank(rank)
        if not info.alive:
            raise ValueError(f"cannot reserve on rank {rank}: it is not alive")
        if blocks < 0 or tokens < 0:
            raise ValueError(f"reservation of {blocks} blocks, {tokens} tokens: both must be >= 0")
        self.release(request_id)  # a re-routed request holds one reservation, not two
        now = self.clock()
        self.reservations[request_id] = Reservation(request_id, rank, blocks, tokens, now)
        self._expiry.append((now, request_id))
        info.reserved_blocks += blocks
        info.reserved_tokens += tokens
        info.num_reservations += 1

    def release(self, request_id: str) -> bool:
        reservation = self.reservations.pop(request_id, None)
        if reservation is None:
            return False
        info = self.ranks[reservation.rank]
        info.reserved_blocks -= reservation.blocks
        info.reserved_tokens -= reservation.tokens
        info.num_reservations -= 1
        return True

    def expire_reservations(self) -> int:
        """Release reservations older than the TTL (their request never reached its rank); how many."""
        deadline = self.clock() - self.reservation_ttl_s
        expired = 0
        while self._expiry and self._expiry[0][0] <= deadline:
            created, request_id = self._expiry.popleft()
            reservation = self.reservations.get(request_id)
            if reservation is not None and reservation.created == created:
                self.release(request_id)
                expired += 1
        return expired

    def _drop_reservations(self, info: RankInfo) -> None:
        if info.num_reservations:
            for request_id in [r.request_id for r in self.reservations.values() if r.rank == info.rank]:
                self.release(request_id)

    # ---- reports ---------------------------------------------------------------------------

    def rank_state(self, rank: int) -> RankState:
        info = self._rank(rank)
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
        ready: dict[int, int] = {}
        for info in self.ranks:
            if info.blocks or info.in_flight:
                assert info.registered and info.alive, f"rank {info.rank} holds entries but is not alive"
            assert bool(self.alive_mask >> info.rank & 1) == (info.registered and info.alive), "alive mask"
            num_ready = 0
            for h in info.blocks:
                if h not in info.in_flight:
                    num_ready += 1
                    ready[h] = ready.get(h, 0) | 1 << info.rank
            assert num_ready == info.num_ready, f"rank {info.rank}: ready count {info.num_ready} != {num_ready}"
        assert ready == self._ready, "ready index does not match the ready entries"
        assert self._stats.keys() <= self._ready.keys(), "stats kept for a hash no rank holds"
        totals = [[0, 0, 0] for _ in self.ranks]
        for request_id, reservation in self.reservations.items():
            assert reservation.request_id == request_id
            assert self.ranks[reservation.rank].alive, f"reservation {request_id} on dead rank {reservation.rank}"
            t = totals[reservation.rank]
            t[0] += reservation.blocks
            t[1] += reservation.tokens
            t[2] += 1
        for info, (blocks, tokens, count) in zip(self.ranks, totals):
            assert (info.reserved_blocks, info.reserved_tokens, info.num_reservations) == (blocks, tokens, count), (
                f"rank {info.rank}: reservation totals"
            )
        pending = {request_id for _, request_id in self._expiry}
        assert self.reservations.keys() <= pending, "a reservation cannot expire"
