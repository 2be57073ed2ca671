"""SGLang's model gateway, ``cache_aware`` policy, as ``smg launch`` runs it.

Reimplements lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` (smg 1.13, the
package ``pip install smg`` installs; its approximate-tree paths; the spill gate from 1.13's
command-line help, the rest from the 1.9 source, the latest we could read) with the command line's
defaults: ``cache_threshold=0.3``, ``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``
(the library's own ``CacheAwareConfig::default`` differs: 0.5 / 32 / 1.1). Load is the
gateway's count of requests sent to a worker and not finished; ours is ``num_waiting +
num_running`` plus requests routed but not yet admitted.

- The worker with the longest prefix match in the gateway's tree if ``matched / prompt >
  cache_threshold``; else (a miss) the least-loaded worker. ``sglang_miss_rule="smallest_tree"``
  restores the older sgl-router rule (a miss to the worker with the smallest tree).
- The spill gate (``sglang_balance_rule="fleet_mean"``, smg 1.13, as its ``--help`` states it):
  the matched worker is passed over for the least-loaded one when its load exceeds the healthy
  workers' mean by a margin *and* exceeds ``balance_rel_threshold`` times the mean. The margin
  is ``balance_abs_threshold`` capped at the natural swing of an in-flight count at that mean,
  two standard deviations, never under 4 (unless the threshold is): ``min(abs, max(4,
  2 * sqrt(mean)))``, the count taken as Poisson (our reading of "natural swing").
  ``"max_min"`` restores smg 1.9 and earlier (``policies/cache_aware.rs``): when ``max_load -
  min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold * min_load``, every
  request goes to the least-loaded worker.
- Every routed prompt is inserted into the chosen worker's tree.

Differences: the gateway's tree holds request text per character (HTTP) or tokens (gRPC);
ours holds chained complete-block hashes, so the match rate is ``matched_blocks * block_size
/ prompt_tokens``. It evicts least recently used leaves on a timer down to ``max_tree_size``;
we evict the least recently routed block at insert time past ``sglang_max_tree_blocks``. With
``sglang_tree="page_table"`` the matches come from the global page table (worker events, as
the gateway's event-driven gRPC mode). Ties go to the lower load, then the lower rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.gate import overloaded
from lmpool.control.pricing.price import Pricer
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route
from lmpool.protocol import RouteQuery
from lmpool.protocol.base import BlockHash


class ApproximateTrees:
    """SGLang's per-worker approximate trees, as chained block hashes: hash -> bitmask of the
    ranks whose tree holds it, and per rank its hashes in least-recently-routed order (the
    tree's size). A rank's tree never holds more than ``max_blocks`` hashes."""

    def __init__(self, world_size: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._holders: dict[BlockHash, int] = {}
        self._lru: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(world_size)]

    def size(self, rank: int) -> int:
        return len(self._lru[rank])

    def match(self, block_hashes: list[BlockHash], ranks: Sequence[int]) -> dict[int, int]:
        """Per rank of ``ranks``, how many leading blocks of ``block_hashes`` its tree holds."""
        remaining = sum(1 << r for r in ranks)
        matches = dict.fromkeys(ranks, 0)
        for i, h in enumerate(block_hashes):
            remaining &= self._holders.get(h, 0)
            if not remaining:
                break
            for r in ranks:
                if remaining >> r & 1:
                    matches[r] = i + 1
        return matches

    def insert(self, rank: int, block_hashes: list[BlockHash]) -> None:
        bit = 1 << rank
        lru = self._lru[rank]
        for h in block_hashes:
            self._holders[h] = self._holders.get(h, 0) | bit
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            h, _ = lru.popitem(last=False)
            mask = self._holders[h] & ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]


class SGLangCacheAwarePolicy(RoutingPolicy):
    def __init__(self, table: PageTableView, config: RoutingConfig, pricer: Pricer) -> None:
        super().__init__(table, config, pricer)
        self.trees: ApproximateTrees | None = None  # None: the page table stands in for them
        if config.sglang_tree == "approximate":
            self.trees = ApproximateTrees(table.world_size, config.sglang_max_tree_blocks)

    def choose(self, route: Route) -> Choice:
        query, ranks, matched = route.query, route.ranks, route.expected
        cfg = self.config
        loads = {}
        for r in ranks:
            info = self.table.ranks[r]
            loads[r] = info.load.num_waiting + info.load.num_running + info.num_reservations
        least = min(ranks, key=lambda r: (loads[r], r))
        if cfg.sglang_balance_rule == "max_min":
            max_load, min_load = max(loads.values()), min(loads.values())
            if (max_load - min_load > cfg.sglang_balance_abs_threshold
                    and max_load > cfg.sglang_balance_rel_threshold * min_load):
                return Choice(least, f"sglang_balance r{least} load={loads[least]} max={max_load}")
        if self.trees is not None:
            matches = self.trees.match(query.block_hashes, ranks)
            sizes = {r: self.trees.size(r) for r in ranks}
        else:
            matches = {r: matched[r] for r in ranks}
            sizes = {r: self.table.ranks[r].num_entries for r in ranks}
        best = min(ranks, key=lambda r: (-matches[r], loads[r], r))
        prompt = query.num_prompt_tokens
        rate = matches[best] * self.table.block_size / prompt if prompt else 0.0
        if rate > cfg.sglang_cache_threshold:
            if cfg.sglang_balance_rule == "fleet_mean" and least != best and overloaded(
                    loads[best], loads.values(), cfg.sglang_balance_abs_threshold, cfg.sglang_balance_rel_threshold):
                return Choice(least, f"sglang_spill r{least} load={loads[least]} over r{best} load={loads[best]}")
            return Choice(best, f"sglang_cache r{best} rate={rate:.2f}")
        if cfg.sglang_miss_rule == "smallest_tree":
            smallest = min(ranks, key=lambda r: (sizes[r], loads[r], r))
            return Choice(smallest, f"sglang_smallest_tree r{smallest} size={sizes[smallest]} rate={rate:.2f}")
        return Choice(least, f"sglang_miss_least_loaded r{least} load={loads[least]} rate={rate:.2f}")

    def routed(self, query: RouteQuery, rank: int) -> None:
        if self.trees is not None:
            self.trees.insert(rank, query.block_hashes)
