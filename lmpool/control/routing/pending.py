"""Pending prefixes: blocks a rank will hold once the requests already routed to it have prefilled.

The page table learns of a block only when its rank reports it, after the prefill
that computed it. A burst of requests sharing a prefix that no rank holds yet would
each see no match anywhere, spread over the ranks by load, and each compute the
prefix: one cold prefill per rank instead of one for the pool, and the prefix then
takes KV space on every rank. So the LMPool policy also counts, per rank, the
complete prompt blocks of the requests it sent there (``add``) as if they were
cached (``extend``): a later request queues behind its producer on that rank and
reuses the blocks, and the producer's own prefill already counts as queued work.

An entry ends when its rank reports the block (``confirm``, called by the page table
for every stored block): from then on the page table knows better, and a block that
is evicted later must stop counting. Otherwise it lives ``ttl_s`` from its latest
``add``, long enough for a queued prefill to finish and be reported; past that the
producer failed or was cancelled, and a stale entry misleads at most that long (the
cost of being misled is one cold prefill).

Invariants: ``extend`` never returns less than the match it was given, and counts
only a contiguous run of live entries right after it; an expired entry is never
counted; a rank holds at most ``max_entries`` entries (the oldest go first); an ``add``
drops at most twice as many expired entries as it adds, oldest first.

``CountPending`` is the route stage: it extends each candidate's expected match before the
policy chooses, and adds the chosen rank's new blocks once it has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from lmpool.control.routing.route import Route, RouteStage
from lmpool.protocol.base import BlockHash

MAX_ENTRIES = 1 << 16


class PendingPrefixes:
    def __init__(self, world_size: int, ttl_s: float, clock: Callable[[], float],
                 max_entries: int = MAX_ENTRIES) -> None:
        if world_size < 1 or not ttl_s > 0 or max_entries < 1:
            raise ValueError(f"need world_size >= 1, ttl_s > 0 and max_entries >= 1, got "
                             f"{world_size}, {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_entries = max_entries
        # Per rank, hash -> expiry, oldest first: one ttl for all, so expiries are in order.
        self._ranks: list[OrderedDict[BlockHash, float]] = [OrderedDict() for _ in range(world_size)]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._ranks)

    def add(self, rank: int, block_hashes: list[BlockHash]) -> None:
        """Requests routed to ``rank`` will compute ``block_hashes`` there."""
        entries = self._ranks[rank]
        now = self.clock()
        # A route's share of the expiry: twice what it adds, so the expired never pile up and
        # a route never pays for a whole ttl's worth at once (expired entries never count).
        self._expire(entries, now, 2 * len(block_hashes) + 1)
        expires = now + self.ttl_s
        move = entries.move_to_end
        for h in block_hashes:  # the newest expiry, at the end: the order stays the expiry order
            entries[h] = expires
            move(h)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def extend(self, rank: int, block_hashes: list[BlockHash], matched: int) -> int:
        """``matched`` plus the pending blocks of ``rank`` that continue it, in order, live now."""
        counts = [0] * len(self._ranks)
        counts[rank] = matched
        self.extend_ranks((rank,), block_hashes, counts)
        return counts[rank]

    def extend_ranks(self, ranks: tuple[int, ...], block_hashes: list[BlockHash], matched: list[int]) -> None:
        """``extend`` each of ``ranks``' ``matched[r]`` in place, all at one instant: a route's
        candidates, in one call rather than one per candidate."""
        now = self.clock()
        end, per_rank = len(block_hashes), self._ranks
        for r in ranks:
            entries = per_rank[r]
            if not entries:
                continue
            n = matched[r]
            while n < end:
                expires = entries.get(block_hashes[n])
                if expires is None or expires <= now:
                    break
                n += 1
            matched[r] = n

    def confirm(self, rank: int, block_hash: BlockHash) -> None:
        """``rank`` reported ``block_hash``: the page table counts it from now on."""
        self._ranks[rank].pop(block_hash, None)

    def drop_rank(self, rank: int) -> None:
        """The rank died or restarted: what was queued there will not be computed."""
        self._ranks[rank].clear()

    @staticmethod
    def _expire(entries: OrderedDict[BlockHash, float], now: float, most: int) -> None:
        """Drop up to ``most`` of the oldest entries, while they have expired."""
        for _ in range(most):
            if not entries:
                return
            h, expires = next(iter(entries.items()))
            if expires > now:
                return
            del entries[h]


class CountPending(RouteStage):
    def __init__(self, pending: PendingPrefixes) -> None:
        self.pending = pending

    def expect(self, route: Route) -> None:
        self.pending.extend_ranks(route.ranks, route.query.block_hashes, route.expected)

    def record(self, route: Route) -> None:
        self.pending.add(route.rank, route.query.block_hashes[route.ready[route.rank]:])

    def rank_down(self, rank: int) -> None:
        self.pending.drop_rank(rank)
