"""NVIDIA Dynamo's KV router: ``cost = overlap_score_weight * prefill_blocks + decode_blocks``.

Reimplements the Dynamo kv_router as its docs ("KV Router", "Routing Concepts": cost
calculation and worker selection) and ``DefaultWorkerSelector`` in its kv-router crate describe
it (no release recorded beyond that), with their defaults ``--kv-overlap-score-weight 1.0``,
``--router-temperature 0.0`` (argmin; ties to the smaller cache tree, else random). With a temperature T > 0 the worker is sampled with probability
proportional to ``exp(-(cost - min) / ((max - min) * T))`` (uniform when all costs tie), from
a generator seeded with ``RoutingConfig.seed``.

Here, per rank: ``prefill_blocks`` = (prompt tokens already waiting there, including reserved
ones, + this prompt's tokens past its cached overlap) / block_size, with the overlap from the
global page table (Dynamo's indexer is also built from worker KV events); ``decode_blocks`` =
the rank's used blocks + reserved blocks + this prompt's blocks (Dynamo de-duplicates blocks
shared with active sequences; we do not). Ties go to the smaller page-table share, then the
lower rank, not at random.
"""

from __future__ import annotations

import math
import random

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.routing.cost import CostModel
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.protocol import RouteQuery


class DynamoKVPolicy(RoutingPolicy):
    def __init__(self, table: PageTableView, config: RoutingConfig, costs: CostModel) -> None:
        super().__init__(table, config, costs)
        self._rng = random.Random(config.seed)

    def choose(self, query: RouteQuery, ranks: list[int], matched: list[int], seed: int | None) -> tuple[int, str]:
        costs = self._costs(query, ranks, matched)
        if self.config.dynamo_temperature == 0.0:
            best = min(ranks, key=lambda r: (costs[r], self.table.ranks[r].num_ready, r))
            return best, f"dynamo_min_cost r{best} cost={costs[best]:.1f}"
        lo, hi = min(costs.values()), max(costs.values())
        if lo == hi:
            weights = [1.0] * len(ranks)
        else:
            scale = (hi - lo) * self.config.dynamo_temperature
            weights = [math.exp(-(costs[r] - lo) / scale) for r in ranks]
        best = self._rng.choices(ranks, weights)[0]
        return best, f"dynamo_sample r{best} cost={costs[best]:.1f} min={lo:.1f}"

    def _costs(self, query: RouteQuery, ranks: list[int], matched: list[int]) -> dict[int, float]:
        block_size = self.table.block_size
        prompt_blocks = -(-query.num_prompt_tokens // block_size)
        costs = {}
        for r in ranks:
            info = self.table.ranks[r]
            new_prefill = max(0, query.num_prompt_tokens - matched[r] * block_size)
            prefill_blocks = (info.load.waiting_prefill_tokens + info.reserved_tokens + new_prefill) / block_size
            decode_blocks = info.load.blocks_used + info.reserved_blocks + prompt_blocks
            costs[r] = self.config.dynamo_overlap_score_weight * prefill_blocks + decode_blocks
        return costs
