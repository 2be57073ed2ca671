"""LMPool's own rule (it reimplements no other system): the cheapest rank in predicted seconds
(``lmpool.control.pricing.price``), leaving a prefix's owner only when it is overloaded.

Every candidate is priced; only capacity-feasible ranks compete (those that can hold the
request, now or once their sequences finish) unless none is (then all do,
"no_capacity", and the worker queues the request). A rank short of blocks now competes with the
wait for them in its price: excluding it sent a session's turn away from its history whenever
its replica's cache was full of running sequences about to finish. The owner is the competing
rank whose expected match is longest, when that match covers more than ``owner_min_match`` of
the prompt (SGLang's cache threshold: a smaller match is a miss); ranks matching as much tie
with it.

- no owner: the cheapest rank ("min_price");
- an owner that the bounded-load gate (``lmpool.control.pricing.gate``, over requests in
  flight) does not find overloaded: the cheapest of the owner and its ties ("owner"), and no
  later stage may send the request elsewhere, even when it must wait for blocks there (what
  the owner's cache holds is why it is the owner; SGLang's gateway does not look at memory),
  unless ``RoutingConfig.owner_pulls``: then a pull may bring the prefix to a cheaper rank;
- an overloaded owner: the cheapest rank ("spill" when it is no owner), and a later stage may
  still pull the prefix to another rank.

Prices within ``price_tie`` of the cheapest tie (``pricing.price.cheapest``): higher topology
affinity to the seed wins, then a longer match, more free blocks, the lower rank. The reason
ends with every candidate's price in milliseconds.
"""

from __future__ import annotations

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.gate import overloaded
from lmpool.control.pricing.price import Pricer, RankPrice, cheapest, describe
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route


class LMPoolPolicy(RoutingPolicy):
    counts_pending = True

    def __init__(self, table: PageTableView, config: RoutingConfig, pricer: Pricer) -> None:
        super().__init__(table, config, pricer)
        # Candidate ranks -> the reason's "; serve r0=%.0f r1=%.0f ..." template (``_serve_prices``):
        # a function of the ranks alone, so it never goes stale; one per candidate set the router
        # forms (every alive rank, or a seed's group), a handful.
        self._serve_formats: dict[tuple[int, ...], str] = {}

    def choose(self, route: Route) -> Choice:
        query, cfg = route.query, self.config
        prices = self.pricer.serve(query, route.ranks, route.expected, route.seed, route.waits)
        pool = [p for p in prices if p.feasible]
        rule = "min_price"
        if not pool:
            pool, rule = prices, "no_capacity"
        best = cheapest(pool, cfg.price_tie)
        top = max([p.matched for p in pool])
        alternatives = self._serve_prices(route.ranks, prices)
        if top * self.table.block_size <= cfg.owner_min_match * query.num_prompt_tokens:
            return Choice(best.rank, describe(rule, best) + alternatives, prices, may_leave=True)
        owners = [p for p in pool if p.matched == top]
        owner = cheapest(owners, cfg.price_tie)
        if not overloaded(owner.seqs, [p.seqs for p in prices], cfg.gate_abs_threshold, cfg.gate_rel_threshold):
            return Choice(owner.rank, describe("owner", owner) + alternatives, prices, may_leave=cfg.owner_pulls)
        if best.matched == top:
            return Choice(best.rank, describe("owner", best) + alternatives, prices, may_leave=True)
        return Choice(best.rank, f"{describe('spill', best)} from {describe('owner', owner)}{alternatives}", prices,
                      may_leave=True)

    def _serve_prices(self, ranks: tuple[int, ...], prices: list[RankPrice]) -> str:
        """"; serve r0=12 r1=15 ...": each candidate's price in milliseconds, ``prices`` being in
        ``ranks``' order (``Pricer.serve``). One ``%`` over the candidates' template, not one
        format per rank: every route writes it."""
        template = self._serve_formats.get(ranks)
        if template is None:
            template = self._serve_formats[ranks] = "; serve " + " ".join([f"r{r}=%.0f" for r in ranks])
        return template % tuple([p.total_s * 1e3 for p in prices])
