"""LMPool's own rule (it reimplements no other system): the minimum projected cost
(``lmpool.control.routing.cost``), with a bounded spill.

Only capacity-feasible ranks compete unless none is (then all do, and the worker queues the
request). The prefix owner is the competing rank with the longest match (ties: lower cost).
The minimum cost wins (ties: higher topology affinity to the seed, longer match, lower rank)
when it is the owner or no rank holds any prefix. Otherwise leaving the owner is a spill,
allowed only when all hold:

    load_owner - min(load over competing ranks) > spill_load_gap_tokens
    cost_s < cost_owner
    missing_s - missing_owner <= spill_max_extra_tokens

and then the cheapest such rank wins ("spill"); else the owner keeps the request
("owner_kept"). With ``pending_ttl_s`` > 0 the matches include each rank's pending prefix.
"""

from __future__ import annotations

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.routing.cost import CostModel, RankCost, describe
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.protocol import RouteQuery


def _cheapest(c: RankCost) -> tuple:
    return c.cost, -c.affinity, -c.matched, c.rank


class LMPoolPolicy(RoutingPolicy):
    counts_pending = True

    def __init__(self, table: PageTableView, config: RoutingConfig, costs: CostModel) -> None:
        super().__init__(table, config, costs)
        self.last_costs: list[RankCost] = []  # the projections of the latest route

    def choose(self, query: RouteQuery, ranks: list[int], matched: list[int], seed: int | None) -> tuple[int, str]:
        costs = self.last_costs = self.costs.project(query, ranks, matched, seed)
        pool = [c for c in costs if c.feasible]
        rule = "min_cost"
        if not pool:
            pool = costs
            rule = "no_capacity"
        best = min(pool, key=_cheapest)
        owner = min(pool, key=lambda c: (-c.matched, c.cost, -c.affinity, c.rank))
        if owner.matched == 0 or owner is best:
            if owner.matched and rule == "min_cost":
                rule = "owner"
            return best.rank, describe(rule, best)
        spill = self._spill(pool, owner)
        if spill is not None:
            return spill.rank, f"{describe('spill', spill)} from {describe('owner', owner)}"
        return owner.rank, f"{describe('owner_kept', owner)} over {describe('cheaper', best)}"

    def _spill(self, pool: list[RankCost], owner: RankCost) -> RankCost | None:
        """The cheapest rank the request may spill to from its overloaded ``owner``, if any."""
        cfg = self.config
        if owner.load - min(c.load for c in pool) <= cfg.spill_load_gap_tokens:
            return None
        spills = [c for c in pool if c.cost < owner.cost and c.missing - owner.missing <= cfg.spill_max_extra_tokens]
        return min(spills, key=_cheapest) if spills else None
