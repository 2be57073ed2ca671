"""Every route's demand, recorded where transfers and pricing read it: the heat of the blocks
some rank holds (``lmpool.control.page_table.heat``), and, when eviction is priced, whether the
prompt wants a block that a rank evicted (``lmpool.control.pricing.eviction``)."""

from __future__ import annotations

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.eviction import EvictionMemory
from lmpool.control.routing.route import Route, RouteStage


class RecordDemand(RouteStage):
    def __init__(self, gbm: GlobalBlockManager, evictions: EvictionMemory | None = None) -> None:
        self.gbm = gbm
        self.evictions = evictions

    def record(self, route: Route) -> None:
        hashes = route.query.block_hashes
        self.gbm.record_route(hashes, max(route.ready), route.ready[route.rank])
        if self.evictions is not None:
            top = max(route.expected)
            if top < len(hashes):  # the first block no rank holds, nor will
                self.evictions.wanted(hashes[top])

    def rank_down(self, rank: int) -> None:
        if self.evictions is not None:
            self.evictions.drop_rank(rank)
