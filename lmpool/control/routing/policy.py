"""The interface of a routing policy: choose one of the candidate ranks for a request, and say why.

The router gives every policy the same candidates (alive ranks, within the seed's NVLink
group when a seed is given), each rank's matched blocks, and a read-only view of the page
table; it takes the reservation, applies the lease override and records demand itself. A
policy keeps only its own state (a round-robin cursor, an emulated router's tree).
"""

from __future__ import annotations

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.routing.cost import CostModel
from lmpool.protocol import RouteQuery


class RoutingPolicy:
    # Whether the router counts this policy's pending prefixes (``lmpool.control.routing.pending``)
    # as matched blocks: blocks of prompts routed to a rank that it has not reported yet.
    counts_pending = False

    def __init__(self, table: PageTableView, config: RoutingConfig, costs: CostModel) -> None:
        self.table = table
        self.config = config
        self.costs = costs

    def choose(self, query: RouteQuery, ranks: list[int], matched: list[int], seed: int | None) -> tuple[int, str]:
        """The rank among ``ranks`` (never empty) for ``query``, and the reason: the rule that
        decided and the rank (``r``), then the rule's figures. ``matched[r]`` is rank r's matched
        blocks (pending ones included when ``counts_pending``)."""
        raise NotImplementedError

    def routed(self, query: RouteQuery, rank: int) -> None:
        """``query`` went to ``rank`` (the policy's choice, or a lease's)."""
