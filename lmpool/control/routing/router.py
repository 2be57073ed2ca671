"""The router: picks the rank for a new request with one routing policy (``registry.POLICIES``)
and the pipeline of stages ``control/build.py`` gives it.

``decide`` takes the candidates (alive ranks, within the seed's NVLink group when a seed is
given, else every alive rank), matches the prompt in the page table, lets each stage raise
what a rank will hold (``expect``), lets the policy choose, and lets each stage settle the
route (``settle``); see ``lmpool.control.routing.route``. ``record`` then lets each stage and
the policy record it: the control process does so once the reply is written, so a route's
bookkeeping is not on its reply's path. Invariant: a decided route is recorded before the
next is decided and before a rank goes down (both record first); ``route`` does both at once.
The stages are what every policy shares (reservations, demand) and what LMPool's adds (pending
prefixes, leases, pulls), so comparisons isolate the rule.

A query pinned to a rank (``RouteQuery.pinned``, ``AsyncLMPool.generate(rank=...)``) that is a
candidate goes there without the policy: its route is priced and settled like any other (its
reservation, demand and pending prefix count), but it carries no candidates' prices, so no stage
moves it, and the policy does not learn it as its own choice.

The decision reports only ready blocks: pending ones never count in ``matched_blocks``. Where
the pricing reads cascade groups, it names the request's group (``Route.group``, which the
reservation stage settles), which its worker counts it under in its load reports.
"""

from __future__ import annotations

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route, RouteStage
from lmpool.control.topology import Topology
from lmpool.protocol import RouteDecision, RouteQuery


class NoAliveRankError(RuntimeError):
    """Every rank is down: there is nowhere to route."""


class Router:
    def __init__(self, gbm: GlobalBlockManager, topology: Topology, policy: RoutingPolicy,
                 stages: list[RouteStage]) -> None:
        if topology.world_size != gbm.world_size:
            raise ValueError(f"topology has {topology.world_size} ranks, the page table {gbm.world_size}")
        self.gbm = gbm
        self.topology = topology
        self.policy = policy
        self.stages = stages
        # Candidate bitmask -> its ranks, ascending: a handful of masks, met route after route.
        self._ranks_of: dict[int, tuple[int, ...]] = {}
        self._unrecorded: tuple[Route, bool] | None = None  # the last decided route, and whether pinned

    def route(self, query: RouteQuery, seed_rank: int | None = None) -> RouteDecision:
        """Choose a rank for ``query``, say why, and record the route (its reservation there)."""
        decision = self.decide(query, seed_rank)
        self.record()
        return decision

    def decide(self, query: RouteQuery, seed_rank: int | None = None) -> RouteDecision:
        """Choose a rank for ``query`` and say why; ``record`` (or the next decision) records it."""
        self.record()
        gbm = self.gbm
        gbm.expire_reservations()
        candidates = self._candidates(seed_rank)
        ranks = self._ranks_of.get(candidates)
        if ranks is None:
            ranks = self._ranks_of[candidates] = tuple(r for r in range(gbm.world_size) if candidates >> r & 1)
        ready = gbm.prefix_match(query.block_hashes, candidates)
        route = Route(query, seed_rank, ranks, ready, list(ready))
        for stage in self.stages:
            stage.expect(route)
        pinned = query.pinned is not None and query.pinned in ranks
        if pinned:
            self._pin(route)
        else:
            route.take(self.policy.choose(route))
        for stage in self.stages:
            stage.settle(route)
        self._unrecorded = (route, pinned)
        chosen = route.chosen
        return RouteDecision(route.rank, ready[route.rank], route.reason, None if chosen is None else chosen.ttft_s,
                             route.group)

    def record(self) -> None:
        """Record the last decided route, if it is not yet: each stage's bookkeeping, then the
        policy's memory of its own choices (a pinned route is not one)."""
        if self._unrecorded is None:
            return
        route, pinned = self._unrecorded
        self._unrecorded = None
        for stage in self.stages:
            stage.record(route)
        if not pinned:
            self.policy.routed(route.query, route.rank)

    def _pin(self, route: Route) -> None:
        """The caller chose the rank: the route is accounted for there (reserved, its demand and
        pending prefix recorded) and priced, but no stage moves it (unpriced routes stay put)."""
        query = route.query
        assert query.pinned is not None  # the route of a pinned query
        route.take(Choice(query.pinned, "pinned"))
        route.chosen = self.policy.pricer.serve(query, [query.pinned], route.expected, route.seed, route.waits)[0]

    def rank_down(self, rank: int) -> None:
        """``rank`` died: the page table forgets it, and nothing routed there will be computed."""
        self.record()
        self.gbm.mark_dead(rank)
        for stage in self.stages:
            stage.rank_down(rank)

    def _candidates(self, seed: int | None) -> int:
        """The seed's NVLink group's routable ranks; else any routable rank (serving elsewhere
        beats failing the request); else, every rank being silent, the alive ones likewise."""
        group = self.topology.candidate_mask(seed)
        for mask in (self.gbm.routable_mask, self.gbm.alive_mask):
            if group & mask:
                return group & mask
            if mask:
                return mask
        # The query's id is the pool's internal dispatch id: the pool names the
        # caller's request when it passes this on.
        raise NoAliveRankError("no alive rank to route the request to")
