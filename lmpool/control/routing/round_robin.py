"""Round robin, the textbook baseline (no one system's source): the candidate ranks in rank
order, skipping those not candidates (dead, or outside the seed's NVLink group). Cache contents
and load play no part."""

from __future__ import annotations

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.price import Pricer
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self, table: PageTableView, config: RoutingConfig, pricer: Pricer) -> None:
        super().__init__(table, config, pricer)
        self._next = 0

    def choose(self, route: Route) -> Choice:
        n = self.table.world_size
        for i in range(n):
            rank = (self._next + i) % n
            if rank in route.ranks:
                self._next = rank + 1
                return Choice(rank, f"round_robin r{rank}")
        raise AssertionError("candidate ranks are never empty")
