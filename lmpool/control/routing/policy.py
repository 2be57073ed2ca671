"""The interface of a routing policy: choose one of the candidate ranks for a request, and say why.

The router gives every policy the same ``Route`` (alive ranks, within the seed's NVLink group
when a seed is given, each rank's expected matched blocks) and a read-only view of the page
table; the pipeline's stages do what all policies share (``lmpool.control.routing.route``). A
policy keeps only its own state (a round-robin cursor, an emulated router's tree); one that
prices its candidates (``lmpool.control.pricing``) returns the prices with its choice.
"""

from __future__ import annotations

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.price import Pricer
from lmpool.control.routing.route import Choice, Route
from lmpool.protocol import RouteQuery


class RoutingPolicy:
    # Whether the router counts pending prefixes (``lmpool.control.routing.pending``) for this
    # policy: blocks of prompts routed to a rank that it has not reported yet.
    counts_pending = False

    def __init__(self, table: PageTableView, config: RoutingConfig, pricer: Pricer) -> None:
        self.table = table
        self.config = config
        self.pricer = pricer

    def choose(self, route: Route) -> Choice:
        """The rank among ``route.ranks`` (never empty) for ``route.query``, and the reason: the
        rule that decided and the rank (``r``), then the rule's figures. ``route.expected[r]`` is
        rank r's matched blocks (pending ones included when ``counts_pending``)."""
        raise NotImplementedError

    def routed(self, query: RouteQuery, rank: int) -> None:
        """``query`` went to ``rank`` (the policy's choice, or a stage's)."""
