"""Placement leases: for a while after a background copy, routes for the copied chain go to it.

A background copy only pays if requests use it, and routing alone keeps a request
on the rank with the longest match (its owner) until the owner is overloaded.
A lease names the copied chain by its deepest block (``leaf``, ``depth`` blocks
from the root) and the rank holding the copy (``dst``); while it lasts, a request
whose prompt contains that chain goes to ``dst`` whenever ``dst`` is
capacity-feasible and its price is below the rank the policy chose (``SteerToLeases``,
a route stage).

Invariants: at most one lease per leaf (a newer placement replaces the older);
an expired lease is never returned and is dropped when met; at most
``max_leases`` are held (the oldest go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from lmpool.control.pricing.price import describe
from lmpool.control.routing.route import Route, RouteStage
from lmpool.protocol.base import BlockHash

MAX_LEASES = 4096


@dataclass(frozen=True)
class Lease:
    leaf: BlockHash  # hash of the deepest copied block
    depth: int  # blocks from the root to ``leaf``, inclusive
    src: int
    dst: int
    expires: float


class PlacementLeases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 max_leases: int = MAX_LEASES) -> None:
        if lease_s <= 0 or max_leases < 1:
            raise ValueError(f"need lease_s > 0 and max_leases >= 1, got {lease_s}, {max_leases}")
        self.lease_s = lease_s
        self.clock = clock
        self.max_leases = max_leases
        self._by_leaf: OrderedDict[BlockHash, Lease] = OrderedDict()
        self._max_depth = 0  # no lease is deeper: bounds the search in ``find``

    def __len__(self) -> int:
        return len(self._by_leaf)

    def grant(self, leaf: BlockHash, depth: int, src: int, dst: int) -> Lease:
        if depth < 1:
            raise ValueError(f"a lease needs depth >= 1, got {depth}")
        lease = Lease(leaf, depth, src, dst, self.clock() + self.lease_s)
        self._by_leaf.pop(leaf, None)
        self._by_leaf[leaf] = lease
        while len(self._by_leaf) > self.max_leases:
            self._by_leaf.popitem(last=False)
        self._max_depth = max(self._max_depth, depth)
        return lease

    def drop(self, leaf: BlockHash) -> None:
        self._by_leaf.pop(leaf, None)
        if not self._by_leaf:
            self._max_depth = 0

    def find(self, block_hashes: list[BlockHash]) -> Lease | None:
        """The deepest live lease whose chain is a prefix of ``block_hashes``.

        Chained hashes name their whole prefix, so a lease matches when its leaf sits
        at index ``depth - 1``: one dict lookup per candidate depth, deepest first."""
        if not self._by_leaf:
            return None
        now = self.clock()
        for i in range(min(len(block_hashes), self._max_depth) - 1, -1, -1):
            lease = self._by_leaf.get(block_hashes[i])
            if lease is None or lease.depth != i + 1:
                continue
            if lease.expires <= now:
                self.drop(lease.leaf)
                continue
            return lease
        return None

    def expire(self) -> int:
        """Drop every expired lease; how many."""
        now = self.clock()
        stale = [leaf for leaf, lease in self._by_leaf.items() if lease.expires <= now]
        for leaf in stale:
            self.drop(leaf)
        return len(stale)


class SteerToLeases(RouteStage):
    """Send a priced route to a live lease's copy when that is cheaper ("lease ... over ...")."""

    def __init__(self, leases: PlacementLeases) -> None:
        self.leases = leases
        self.routed = 0  # requests a lease took from the policy's choice

    def settle(self, route: Route) -> None:
        if route.prices is None:
            return
        lease = self.leases.find(route.query.block_hashes)
        if lease is None or lease.dst == route.rank or lease.dst not in route.ranks:
            return
        if route.ready[lease.dst] < lease.depth:  # the copy is gone: so is the lease's point
            self.leases.drop(lease.leaf)
            return
        copy = route.price_of(lease.dst)
        assert copy is not None  # a priced route prices each of its ranks, lease.dst among them
        if not copy.feasible or route.chosen is None or copy.total_s >= route.chosen.total_s:
            return
        self.routed += 1
        route.rank, route.chosen = copy.rank, copy
        route.reason = f"{describe('lease', copy)} over {route.reason}"
