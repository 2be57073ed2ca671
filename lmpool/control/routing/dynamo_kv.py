"""NVIDIA Dynamo's KV router: ``cost = overlap_score_weight * prefill_blocks + decode_blocks``.

Reimplements the Dynamo kv_router as its router design doc and ``DefaultWorkerSelector``
describe it (ai-dynamo/dynamo ``docs/design_docs/router_design.md``, 2026), with its
defaults: ``--kv-overlap-score-weight 1.0``, ``--router-temperature 0.0`` (argmin), KV events
on and ``router_assume_kv_reuse``. With a temperature T > 0 the worker is sampled with
probability proportional to ``exp(-(cost - min) / ((max - min) * T))`` (uniform when all costs
tie), from a generator seeded with ``RoutingConfig.seed``.

Per rank, with the overlap from the global page table (Dynamo's indexer is built from worker
KV events too):
- ``prefill_blocks`` = (new prefill tokens already there + this prompt's tokens past its
  overlap) / block_size. A request's new prefill tokens are its prompt less its overlap: for
  requests routed but not yet admitted, the reservation's tokens; for queued and running ones,
  the rank's ``LoadReport.new_prefill_tokens``. (Dynamo holds a request's prefill until its first
  token; ``dynamo_prefill_tokens="full"`` charges every uncomputed prompt token instead, as
  LMPool's first copy did.)
- ``decode_blocks`` = the rank's used blocks + reserved blocks + the blocks this prompt adds
  there (its blocks past the overlap: shared blocks are counted once, as with
  ``router_assume_kv_reuse``; ``dynamo_assume_kv_reuse=False`` counts all its blocks).

Differences: ties go to the smaller page-table share, then the lower rank, not at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.price import Pricer
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route
from lmpool.protocol import RouteQuery


class DynamoKVPolicy(RoutingPolicy):
    def __init__(self, table: PageTableView, config: RoutingConfig, pricer: Pricer) -> None:
        super().__init__(table, config, pricer)
        self._rng = random.Random(config.seed)

    def choose(self, route: Route) -> Choice:
        ranks = route.ranks
        costs = self._costs(route.query, ranks, route.expected)
        if self.config.dynamo_temperature == 0.0:
            best = min(ranks, key=lambda r: (costs[r], self.table.ranks[r].num_ready, r))
            return Choice(best, f"dynamo_min_cost r{best} cost={costs[best]:.1f}")
        lo, hi = min(costs.values()), max(costs.values())
        if lo == hi:
            weights = [1.0] * len(ranks)
        else:
            scale = (hi - lo) * self.config.dynamo_temperature
            weights = [math.exp(-(costs[r] - lo) / scale) for r in ranks]
        best = self._rng.choices(ranks, weights)[0]
        return Choice(best, f"dynamo_sample r{best} cost={costs[best]:.1f} min={lo:.1f}")

    def _costs(self, query: RouteQuery, ranks: Sequence[int], matched: list[int]) -> dict[int, float]:
        block_size = self.table.block_size
        prompt_blocks = -(-query.num_prompt_tokens // block_size)
        new_only = self.config.dynamo_prefill_tokens == "new"
        costs = {}
        for r in ranks:
            info = self.table.ranks[r]
            new_prefill = max(0, query.num_prompt_tokens - matched[r] * block_size)
            queued = info.load.new_prefill_tokens if new_only else info.load.waiting_prefill_tokens
            prefill_blocks = (queued + info.reserved_tokens + new_prefill) / block_size
            added = prompt_blocks - matched[r] if self.config.dynamo_assume_kv_reuse else prompt_blocks
            decode_blocks = info.load.blocks_used + info.reserved_blocks + added
            costs[r] = self.config.dynamo_overlap_score_weight * prefill_blocks + decode_blocks
        return costs
