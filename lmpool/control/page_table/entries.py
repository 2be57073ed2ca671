"""The page table's entries: which rank holds which block, applied from worker snapshots and deltas.

Per rank, ``hash -> generation << 32 | block_id`` (one int per entry, block ids below 2**32: a
million entries cost no tuples and give the garbage collector nothing to trace), the snapshot
version applied so far, and one routing index over all ranks: ``hash -> bitmask of the ranks
holding a ready copy``. An entry is ready unless its hash is in flight on that rank.

Invariants: the ready index holds exactly the ready entries; each rank's ``num_ready`` counts
them; a snapshot replaces a rank's entries wholesale and is stale (``StaleUpdateError``) below
the applied version; a delta applies only from the applied version, else it is a gap.
"""

from __future__ import annotations

from collections.abc import Callable

from lmpool.control.page_table.in_flight import InFlight
from lmpool.control.page_table.ranks import StaleUpdateError
from lmpool.protocol.base import BlockHash
from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot


class RankEntries:
    __slots__ = ("rank", "blocks", "num_ready", "version")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.blocks: dict[BlockHash, int] = {}  # hash -> generation << 32 | block_id
        self.num_ready = 0
        self.version: int | None = None  # snapshot version applied so far; None awaits a snapshot


class EntryTable:
    def __init__(self, world_size: int, in_flight: InFlight, on_unheld: Callable[[BlockHash], None]) -> None:
        self.ranks = [RankEntries(r) for r in range(world_size)]
        self.ready: dict[BlockHash, int] = {}  # hash -> bitmask of ranks holding a ready copy
        self._in_flight = in_flight.ranks
        self._on_unheld = on_unheld  # told a hash no rank holds ready any more
        # Told (rank, hash) whenever a rank reports a block (``watch_stored``), or removes one (``watch_removed``).
        self._on_stored: Callable[[int, BlockHash], None] | None = None
        self._on_removed: Callable[[int, BlockHash], None] | None = None
        self.snapshots_applied = 0
        self.deltas_applied = 0
        self.gaps = 0
        self.stale_rejected = 0

    def watch_stored(self, callback: Callable[[int, BlockHash], None]) -> None:
        self._on_stored = callback

    def watch_removed(self, callback: Callable[[int, BlockHash], None]) -> None:
        self._on_removed = callback

    # ---- worker reports ----------------------------------------------------------------

    def apply_snapshot(self, rank: int, snapshot: KVSnapshot) -> None:
        entries = self.ranks[rank]
        if entries.version is not None and snapshot.version < entries.version:
            self.stale_rejected += 1
            raise StaleUpdateError(
                f"rank {rank}: snapshot version {snapshot.version} is older than the applied {entries.version}"
            )
        self._drop(rank)
        for stored in snapshot.blocks:
            self._store(entries, stored)
        entries.version = snapshot.version
        self.snapshots_applied += 1

    def apply_delta(self, rank: int, delta: KVDelta) -> bool:
        entries = self.ranks[rank]
        if delta.to_version - delta.from_version != len(delta.events):
            raise ValueError(
                f"rank {rank}: delta {delta.from_version}->{delta.to_version} carries {len(delta.events)} events"
            )
        if entries.version is None or delta.from_version != entries.version:
            self.gaps += 1
            return False
        for event in delta.events:
            if type(event) is BlockStored:
                self._store(entries, event)
            else:
                self._remove(entries, event.block_hash, event.block_id, event.generation)
        entries.version = delta.to_version
        self.deltas_applied += 1
        return True

    def forget(self, rank: int) -> None:
        """The rank's incarnation ended: no entries, and it awaits a snapshot. Call it before
        its in-flight markers are cleared (a marked entry is not in the ready index)."""
        self._drop(rank)
        self.ranks[rank].version = None

    def _drop(self, rank: int) -> None:
        entries = self.ranks[rank]
        in_flight = self._in_flight[rank]
        for h in entries.blocks:
            if h not in in_flight:
                self._set_ready(entries, h, False)
        entries.blocks = {}
        assert entries.num_ready == 0

    def _store(self, entries: RankEntries, stored: BlockStored) -> None:
        h = stored.block_hash
        blocks = entries.blocks
        known = h in blocks
        blocks[h] = stored.generation << 32 | stored.block_id
        if not known and h not in self._in_flight[entries.rank]:
            self._set_ready(entries, h, True)
        if self._on_stored is not None:
            self._on_stored(entries.rank, h)

    def _remove(self, entries: RankEntries, h: BlockHash, block_id: int, generation: int) -> None:
        # A removal of another copy (an older generation, or a transfer's reserved block) is not this entry's.
        if entries.blocks.get(h) != generation << 32 | block_id:
            return
        del entries.blocks[h]
        if h not in self._in_flight[entries.rank]:
            self._set_ready(entries, h, False)
        if self._on_removed is not None:
            self._on_removed(entries.rank, h)

    def _set_ready(self, entries: RankEntries, h: BlockHash, ready: bool) -> None:
        """Add or remove the rank's bit of ``h`` in the ready index (only called on a change)."""
        bit = 1 << entries.rank
        if ready:
            self.ready[h] = self.ready.get(h, 0) | bit
            entries.num_ready += 1
            return
        mask = self.ready.get(h, 0) & ~bit
        if mask:
            self.ready[h] = mask
        else:
            self.ready.pop(h, None)
            self._on_unheld(h)
        entries.num_ready -= 1

    # ---- transfers: blocks not yet visible to routing ------------------------------------

    def mark_in_flight(self, rank: int, block_hash: BlockHash, reserved: int) -> bool:
        """Hold ``reserved`` (packed) for ``block_hash`` as not ready; False when a ready copy is here."""
        entries = self.ranks[rank]
        in_flight = self._in_flight[rank]
        if block_hash in entries.blocks and block_hash not in in_flight:
            return False
        in_flight[block_hash] = reserved
        entries.blocks.setdefault(block_hash, reserved)
        return True

    def unmark_in_flight(self, rank: int, block_hash: BlockHash, published: bool) -> None:
        """Publish the block, or on an abort drop the reserved block (a worker's own copy stays)."""
        reserved = self._in_flight[rank].pop(block_hash, None)
        entries = self.ranks[rank]
        entry = entries.blocks.get(block_hash)
        if reserved is None or entry is None:
            return  # not marked, or a snapshot or removal dropped it meanwhile
        if published or entry != reserved:
            self._set_ready(entries, block_hash, True)
        else:
            del entries.blocks[block_hash]

    # ---- reads ---------------------------------------------------------------------------

    def prefix_match(self, block_hashes: list[BlockHash], remaining: int, world_size: int) -> list[int]:
        """Per rank of the bitmask ``remaining``, how many leading blocks of ``block_hashes`` it holds
        ready as one contiguous chain. The walk keeps the ranks still matching as a bitmask and
        stops as soon as it is empty, so a miss costs one dict lookup."""
        lengths = [0] * world_size
        get = self.ready.get
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

    def check(self) -> None:
        ready: dict[BlockHash, int] = {}
        for entries in self.ranks:
            in_flight = self._in_flight[entries.rank]
            num_ready = 0
            for h in entries.blocks:
                if h not in in_flight:
                    num_ready += 1
                    ready[h] = ready.get(h, 0) | 1 << entries.rank
            assert num_ready == entries.num_ready, (
                f"rank {entries.rank}: ready count {entries.num_ready} != {num_ready}")
        assert ready == self.ready, "ready index does not match the ready entries"
