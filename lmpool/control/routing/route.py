"""One route as it passes the router's pipeline, and the interface of a pipeline stage.

The router fills a ``Route`` with the candidates and each rank's ready match; each stage may
then raise what a rank will hold when the request runs there (``expect``: pending prefixes,
pulls under way); the policy chooses (a ``Choice``, with its priced candidates if it prices);
each stage then settles the route in turn (``settle``: steer to a lease, pull), which ends the
decision. Once the reply is on its way, each stage records the route (``record``: its pending
prefix, reservation, demand, placement's chain), always before the next route is decided.
``control/build.py`` lists the stages, in that order.

Invariants: ``expected[r] >= ready[r]`` for every rank; ``waits[r]`` is set only where
``expected[r]`` counts blocks a pull is still bringing; ``rank`` is a candidate once chosen,
and ``chosen`` (when set) is its price, for the option the stages settled on.
"""

from __future__ import annotations

import msgspec

from lmpool.control.pricing.price import RankPrice
from lmpool.protocol import RouteQuery
from lmpool.protocol.base import BlockHash


class Choice(msgspec.Struct, frozen=True):
    """A policy's decision: the rank, why, and (a pricing policy) every candidate's price;
    ``may_leave``: whether a later stage may still send the request elsewhere (a pull).
    Structs, this and ``Route``: every route builds one of each, and a struct is built in C."""

    rank: int
    reason: str
    prices: list[RankPrice] | None = None
    may_leave: bool = False


class Route(msgspec.Struct):
    query: RouteQuery
    seed: int | None
    ranks: tuple[int, ...]  # the candidates, ascending (shared between routes: never changed)
    ready: list[int]  # per rank: matched blocks published there (what the decision reports)
    expected: list[int]  # ... and what it will hold once its pending prefill and open pulls are done
    waits: dict[int, float] = msgspec.field(default_factory=dict)  # rank -> seconds until its pull has landed
    rank: int = -1
    reason: str = ""
    prices: list[RankPrice] | None = None
    may_leave: bool = False
    chosen: RankPrice | None = None  # the chosen option's price, when the policy prices
    waits_on_pull: bool = False  # it runs on its rank only once a pull there ends (its work is deferred)
    # Set in ``settle`` by the reservation stage (``Reserve``), where the ranks run cascades or the
    # pricing reads groups: the leading blocks of its chain other routed prompts share
    # (``branched_depth``), and, where the pricing reads groups (``Limits.cascade_groups``), its
    # group (``group_key``), which the decision carries to its worker.
    depth: int = 0
    group: BlockHash | None = None

    def take(self, choice: Choice) -> None:
        self.rank, self.reason, self.prices, self.may_leave = (choice.rank, choice.reason, choice.prices,
                                                               choice.may_leave)
        self.chosen = self.price_of(self.rank)

    def price_of(self, rank: int) -> RankPrice | None:
        for p in self.prices or ():
            if p.rank == rank:
                return p
        return None


class RouteStage:
    """A step of every route; the default does nothing at either point."""

    def expect(self, route: Route) -> None:
        """Before the policy: raise ``route.expected`` (and ``waits``) where a rank will hold more."""

    def settle(self, route: Route) -> None:
        """After the policy: change the choice, or act on it (part of the decision)."""

    def record(self, route: Route) -> None:
        """After the decision, off the reply's path: what later routes must see of this one."""

    def rank_down(self, rank: int) -> None:
        """``rank`` died or restarted: forget what this stage held for it."""
