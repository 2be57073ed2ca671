"""The LMPool cost model: what sending a request to a rank would cost, in token-equivalents.

For rank r, with P prompt tokens, B tokens per block, M max new tokens:

    m_r      = min(prefix_match_r, (P - 1) // B)   # the last prompt token is always recomputed
    missing  = P - m_r * B
    need     = ceil((P + M) / B) - m_r               # new blocks the request will hold
    free     = blocks_free - reserved_blocks          # reservations use free blocks first
    reclaim  = max(0, need - max(0, free))            # cached blocks it would have to evict
    queue    = waiting_prefill_tokens + reserved_tokens
    decode   = decode_weight * (decode_tokens_left | num_running)   # config.decode_work
    load     = queue + decode
    cost     = load + missing + reclaim_weight * reclaim * B

A rank is capacity-feasible for the request when ``free + blocks_reclaimable >= need``. The
LMPool policy decides with these projections; the router uses them for lease steering and
placement for its load skew. ``describe`` writes a projection into a decision's reason.
"""

from __future__ import annotations

from typing import NamedTuple

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.control.topology import Topology
from lmpool.protocol import RouteQuery


class RankCost(NamedTuple):
    """One candidate's projection for one request."""

    rank: int
    matched: int  # usable matched blocks
    missing: int  # prompt tokens to compute
    need: int  # new blocks the request would hold
    available: int  # free + reclaimable - reserved blocks
    load: float  # queue + decode-weighted work already there
    cost: float
    affinity: int  # to the seed rank

    @property
    def feasible(self) -> bool:
        return self.available >= self.need


class CostModel:
    def __init__(self, table: PageTableView, topology: Topology, config: RoutingConfig) -> None:
        self.table = table
        self.topology = topology
        self.config = config

    def project(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None) -> list[RankCost]:
        """The cost of sending ``query`` to each of ``ranks``, given each rank's matched blocks ``lengths``."""
        cfg = self.config
        infos = self.table.ranks
        block_size = self.table.block_size
        by_tokens = cfg.decode_work == "tokens"
        reclaim_tokens = cfg.reclaim_weight * block_size
        affinity = self.topology.affinity
        # ``request_shape``, inlined: this loop runs for every candidate of every route.
        prompt = query.num_prompt_tokens
        usable = max(0, (prompt - 1) // block_size)
        total_blocks = -(-(prompt + query.max_tokens) // block_size)
        costs = []
        for r in ranks:
            info = infos[r]
            load = info.load
            m = min(lengths[r], usable)
            missing = prompt - m * block_size
            need = max(0, total_blocks - m)
            free = load.blocks_free - info.reserved_blocks
            reclaim = max(0, need - max(0, free))
            decode = load.decode_tokens_left if by_tokens else load.num_running
            work = load.waiting_prefill_tokens + info.reserved_tokens + cfg.decode_weight * decode
            cost = work + missing + reclaim_tokens * reclaim
            near = 0 if seed is None else affinity(seed, r)
            costs.append(RankCost(r, m, missing, need, free + load.blocks_reclaimable, work, cost, near))
        return costs

    def load(self, rank: int) -> float:
        """Work already queued on ``rank``: ``project()``'s load term."""
        info = self.table.ranks[rank]
        load = info.load
        decode = load.decode_tokens_left if self.config.decode_work == "tokens" else load.num_running
        return load.waiting_prefill_tokens + info.reserved_tokens + self.config.decode_weight * decode


def describe(rule: str, c: RankCost) -> str:
    """A decision's reason: the rule that decided, the rank, its matched blocks and its cost."""
    return f"{rule} r{c.rank} m{c.matched} cost={c.cost:.0f}"


def request_shape(query: RouteQuery, matched: int, block_size: int) -> tuple[int, int, int]:
    """(usable matched blocks, prompt tokens to compute, new blocks to hold) on a rank matching ``matched``.

    The worker recomputes the last prompt token to get logits, so a fully cached
    prompt still computes its final block (``BlockManager.match_prefix``).
    """
    prompt = query.num_prompt_tokens
    m = min(matched, max(0, (prompt - 1) // block_size))
    need = max(0, -(-(prompt + query.max_tokens) // block_size) - m)
    return m, prompt - m * block_size, need
