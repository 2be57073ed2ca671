"""Routing: pick the rank for a new request from the global page table and each rank's load.

``GlobalScheduler.route_sequence_meta`` runs one policy over the candidate ranks
(alive, and within the seed's NVLink group when a seed is given), takes a route
reservation on the chosen rank, records the prompt's demand in the page table's
per-hash stats, and returns a ``RouteDecision`` whose ``reason`` is a compact
log line: the rule that decided, the chosen rank (``r``), its matched blocks
(``m``) and its projected cost.

Every policy reserves the same way: ``tokens`` = the prompt tokens the rank
must still compute, ``blocks`` = the new blocks the request needs there, capped
at what the rank has left, so reservations never promise capacity that a rank
did not report. Reservations count as queue work and used capacity until the
rank's ``LoadReport`` lists the request as admitted (or the TTL passes).

The LMPool policy (``"lmpool"``), all in token-equivalents. For rank r, with
P prompt tokens, B tokens per block, M max new tokens:

    m_r      = min(prefix_match_r, (P - 1) // B)   # the last prompt token is always recomputed
    missing  = P - m_r * B
    need     = ceil((P + M) / B) - m_r               # new blocks the request will hold
    free     = blocks_free - reserved_blocks          # reservations use free blocks first
    reclaim  = max(0, need - max(0, free))            # cached blocks it would have to evict
    queue    = waiting_prefill_tokens + reserved_tokens
    decode   = decode_weight * (decode_tokens_left | num_running)   # config.decode_work
    load     = queue + decode
    cost     = load + missing + reclaim_weight * reclaim * B

With ``pending_ttl_s`` > 0 (the default), ``prefix_match_r`` also counts the rank's pending prefix
(``lmpool.control.routing.pending``): blocks of prompts already routed there that it has not
reported yet, which the request will find there once it has queued behind them. So a
burst sharing a new prefix goes to one owner instead of one cold prefill per rank. The
decision still reports (and the control plane checks) only the ready blocks.

A rank is capacity-feasible when ``free + blocks_reclaimable >= need``; only
feasible ranks compete unless none is (then all do, and the worker queues the
request). The prefix owner is the competing rank with the longest match (ties:
lower cost). The minimum cost wins (ties: higher topology affinity to the seed,
longer match, lower rank) when it is the owner or no rank holds any prefix.
Otherwise leaving the owner is a spill, allowed only when all hold:

    load_owner - min(load over competing ranks) > spill_load_gap_tokens
    cost_s < cost_owner
    missing_s - missing_owner <= spill_max_extra_tokens

and then the cheapest such rank wins ("spill"); else the owner keeps the
request ("owner_kept"). So small load differences never move a request off its
cache, and a spill never recomputes more than ``spill_max_extra_tokens`` of
prefix it could have reused (longer shared prefixes are for KV transfers to
move, not for recomputation).

The baselines are documented on their methods. Every policy sees the same
candidates and the same reservations, so comparisons isolate the rule.

Placement leases (``lmpool.control.transfers.leases``), when background placement runs,
apply after any policy: if the prompt contains a leased chain, the lease's rank
still holds it, is a candidate and capacity-feasible, and its projected cost
(the LMPool terms above) is below the chosen rank's, the lease's rank gets the
request ("lease ... over ..."); ``lease_routed`` counts these.

Route-time pulls (``lmpool.control.transfers.pull``), when they run, reprice the LMPool
policy's choice last: serve, recompute or pull the prefix first, per candidate.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import NamedTuple

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.transfers.leases import PlacementLeases
from lmpool.control.routing.pending import PendingPrefixes
from lmpool.control.topology import Topology
from lmpool.config.routing import RoutingConfig
from lmpool.protocol import RouteDecision, RouteQuery

POLICIES = ("lmpool", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv")


class NoAliveRankError(RuntimeError):
    """Every rank is down: there is nowhere to route."""


class RankCost(NamedTuple):
    """One candidate's projection for one request (the LMPool policy's terms, in token-equivalents)."""

    rank: int
    matched: int  # usable matched blocks
    missing: int  # prompt tokens to compute
    need: int  # new blocks the request would hold
    available: int  # free + reclaimable - reserved blocks
    load: float  # queue + decode-weighted work already there
    cost: float
    affinity: int  # to the seed rank


class GlobalScheduler:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        topology: Topology,
        policy: str = "lmpool",
        config: RoutingConfig | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if topology.world_size != gbm.world_size:
            raise ValueError(f"topology has {topology.world_size} ranks, the page table {gbm.world_size}")
        self.gbm = gbm
        self.topology = topology
        self.policy = policy
        self.config = config or RoutingConfig()
        self.last_costs: list[RankCost] = []  # the LMPool policy's projections for the latest route
        self.last_held = 0  # blocks of the latest routed prompt cached on some candidate rank
        self.leases: PlacementLeases | None = None  # set when background placement runs
        self.lease_routed = 0
        self.pulls = None  # route-time pulls (``RoutePulls``), set when they run
        self.pending: PendingPrefixes | None = None  # the LMPool policy's blocks routed, not yet reported
        if policy == "lmpool" and self.config.pending_ttl_s > 0:
            self.pending = PendingPrefixes(gbm.world_size, self.config.pending_ttl_s, gbm.clock)
            gbm.on_stored = self.pending.confirm
        self._route = getattr(self, "_route_" + policy)
        self._rr_next = 0
        self._rng = random.Random(self.config.seed)
        # SGLang's approximate per-worker trees, as chained block hashes: hash -> ranks bitmask,
        # and per rank the hashes in least-recently-routed order (its "tree size").
        self._sgl_tree: dict[int, int] = {}
        self._sgl_lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(gbm.world_size)]

    def route_sequence_meta(self, query: RouteQuery, seed_rank: int | None = None) -> RouteDecision:
        """Choose a rank for ``query``, reserve capacity there, and say why."""
        gbm = self.gbm
        gbm.expire_reservations()
        candidates = self.topology.candidate_mask(seed_rank) & gbm.alive_mask
        if not candidates:
            # The seed's whole NVLink group is down: serving elsewhere beats failing the request.
            candidates = gbm.alive_mask
            if not candidates:
                # The query's id is the pool's internal dispatch id: the pool names the
                # caller's request when it passes this on.
                raise NoAliveRankError("no alive rank to route the request to")
        ranks = [r for r in range(gbm.world_size) if candidates >> r & 1]
        lengths = gbm.prefix_match(query.block_hashes, candidates)  # ready blocks: what the decision reports
        expected = lengths  # ... and, with pending prefixes, what each rank will hold when the request runs
        if self.pending is not None:
            expected = [self.pending.extend(r, query.block_hashes, n) if candidates >> r & 1 else n
                        for r, n in enumerate(lengths)]
        rank, reason = self._route(query, ranks, expected, seed_rank)
        if self.leases:
            rank, reason = self._steer(query, candidates, lengths, expected, seed_rank, rank, reason)
        if self.pulls is not None and self.policy == "lmpool":  # lmpool.control.transfers.pull
            rank, reason, expected = self.pulls.reprice(query, self.last_costs, lengths, expected, rank, reason)
        self._reserve(query, rank, expected[rank])
        if self.pending is not None:
            self.pending.add(rank, query.block_hashes[lengths[rank]:])
        self.last_held = max(lengths)
        gbm.record_route(query.block_hashes, self.last_held, lengths[rank])
        if self.policy == "sglang_cache_aware" and self.config.sglang_tree == "approximate":
            self._sgl_insert(rank, query.block_hashes)
        return RouteDecision(rank, lengths[rank], reason)

    def rank_down(self, rank: int) -> None:
        """``rank`` died: the page table forgets it, and nothing routed there will be computed."""
        self.gbm.mark_dead(rank)
        if self.pending is not None:
            self.pending.drop_rank(rank)

    def _steer(self, query: RouteQuery, candidates: int, lengths: list[int], expected: list[int],
               seed: int | None, rank: int, reason: str) -> tuple[int, str]:
        """Send the request to a placement lease's copy when that is cheaper (module docstring)."""
        lease = self.leases.find(query.block_hashes)
        if lease is None or lease.dst == rank or not candidates >> lease.dst & 1:
            return rank, reason
        if lengths[lease.dst] < lease.depth:  # the copy is gone: so is the lease's point
            self.leases.drop(lease.leaf)
            return rank, reason
        chosen, copy = self.project(query, [rank, lease.dst], expected, seed)
        if copy.available < copy.need or copy.cost >= chosen.cost:
            return rank, reason
        self.lease_routed += 1
        return copy.rank, f"{_describe('lease', copy)} over {reason}"

    def rank_load(self, rank: int) -> float:
        """Work already queued on ``rank``, in token-equivalents: ``project()``'s load term."""
        info = self.gbm.ranks[rank]
        load = info.load
        decode = load.decode_tokens_left if self.config.decode_work == "tokens" else load.num_running
        return load.waiting_prefill_tokens + info.reserved_tokens + self.config.decode_weight * decode

    def _reserve(self, query: RouteQuery, rank: int, matched: int) -> None:
        _, missing, need = _request_shape(query, matched, self.gbm.block_size)
        blocks = min(need, max(0, self.gbm.ranks[rank].blocks_available))
        self.gbm.reserve(query.request_id, rank, blocks, missing)

    # ---- LMPool ------------------------------------------------------------------------

    def project(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None) -> list[RankCost]:
        """The LMPool cost model for sending ``query`` to each of ``ranks`` (see the module docstring)."""
        cfg = self.config
        infos = self.gbm.ranks
        block_size = self.gbm.block_size
        by_tokens = cfg.decode_work == "tokens"
        reclaim_tokens = cfg.reclaim_weight * block_size
        affinity = self.topology.affinity
        costs = []
        for r in ranks:
            info = infos[r]
            load = info.load
            m, missing, need = _request_shape(query, lengths[r], block_size)
            free = load.blocks_free - info.reserved_blocks
            reclaim = max(0, need - max(0, free))
            decode = load.decode_tokens_left if by_tokens else load.num_running
            work = load.waiting_prefill_tokens + info.reserved_tokens + cfg.decode_weight * decode
            cost = work + missing + reclaim_tokens * reclaim
            near = 0 if seed is None else affinity(seed, r)
            costs.append(RankCost(r, m, missing, need, free + load.blocks_reclaimable, work, cost, near))
        return costs

    def _route_lmpool(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None):
        costs = self.last_costs = self.project(query, ranks, lengths, seed)
        pool = [c for c in costs if c.available >= c.need]
        rule = "min_cost"
        if not pool:
            pool = costs
            rule = "no_capacity"
        best = min(pool, key=lambda c: (c.cost, -c.affinity, -c.matched, c.rank))
        owner = min(pool, key=lambda c: (-c.matched, c.cost, -c.affinity, c.rank))
        if owner.matched == 0 or owner is best:
            if owner.matched and rule == "min_cost":
                rule = "owner"
            return best.rank, _describe(rule, best)
        cfg = self.config
        min_load = min(c.load for c in pool)
        if owner.load - min_load > cfg.spill_load_gap_tokens:
            spills = [
                c for c in pool
                if c.cost < owner.cost and c.missing - owner.missing <= cfg.spill_max_extra_tokens
            ]
            if spills:
                target = min(spills, key=lambda c: (c.cost, -c.affinity, -c.matched, c.rank))
                return target.rank, f"{_describe('spill', target)} from {_describe('owner', owner)}"
        return owner.rank, f"{_describe('owner_kept', owner)} over {_describe('cheaper', best)}"

    # ---- baselines -----------------------------------------------------------------------

    def _route_round_robin(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None):
        """Round robin over the candidate ranks, in rank order, skipping dead ones."""
        n = self.gbm.world_size
        for i in range(n):
            rank = (self._rr_next + i) % n
            if rank in ranks:
                self._rr_next = rank + 1
                return rank, f"round_robin r{rank}"
        raise AssertionError("candidate ranks are never empty")

    def _route_least_loaded(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None):
        """vLLM's data-parallel load balancing: the minimum of ``4 * waiting + running``.

        Source: vLLM v1 ``DPLBAsyncMPClient.get_core_engine_for_request``
        (vllm/v1/engine/core_client.py): ``score = waiting * 4 + running``, the
        first minimum in scan order wins (one client scans from rank 0), and the
        client bumps the chosen engine's local waiting count until the next
        stats update. That bump is our route reservation: waiting = the rank's
        reported ``num_waiting`` + its requests routed but not yet admitted.
        Cache contents play no part.
        """
        best, best_score = ranks[0], math.inf
        for r in ranks:
            info = self.gbm.ranks[r]
            score = 4 * (info.load.num_waiting + info.num_reservations) + info.load.num_running
            if score < best_score:
                best, best_score = r, score
        return best, f"least_loaded r{best} score={best_score}"

    def _route_sglang_cache_aware(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None):
        """SGLang's cache-aware router (sgl-router, ``cache_aware`` policy), with its defaults.

        Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` and
        the sgl-router README: defaults ``cache_threshold=0.5``,
        ``balance_abs_threshold=32``, ``balance_rel_threshold=1.0001``. Load is the
        router's count of requests sent to a worker and not finished; ours is
        ``num_waiting + num_running`` plus requests routed but not yet admitted.

        - Imbalanced when ``max_load - min_load > balance_abs_threshold`` and
          ``max_load > balance_rel_threshold * min_load``: the least-loaded worker.
        - Else the worker with the longest prefix match in the router's tree, if
          ``matched / prompt > cache_threshold``; else the worker with the
          smallest tree (the most room to cache).
        - Every routed prompt is inserted into the chosen worker's tree.

        Differences: SGLang's tree holds request text per character; ours holds
        chained complete-block hashes, so the match rate is
        ``matched_blocks * block_size / prompt_tokens``. It evicts least recently
        used leaves every 60 s down to ``max_tree_size``; we evict the least
        recently routed block at insert time past ``sglang_max_tree_blocks``. With
        ``sglang_tree="page_table"`` the matches and tree sizes come from the
        global page table (worker events) instead. Ties go to the lower load,
        then the lower rank.
        """
        cfg = self.config
        gbm = self.gbm
        loads = {}
        for r in ranks:
            info = gbm.ranks[r]
            loads[r] = info.load.num_waiting + info.load.num_running + info.num_reservations
        max_load, min_load = max(loads.values()), min(loads.values())
        imbalanced = (
            max_load - min_load > cfg.sglang_balance_abs_threshold
            and max_load > cfg.sglang_balance_rel_threshold * min_load
        )
        if imbalanced:
            best = min(ranks, key=lambda r: (loads[r], r))
            return best, f"sglang_balance r{best} load={loads[best]} max={max_load}"
        if cfg.sglang_tree == "approximate":
            matches = self._sgl_match(query.block_hashes, ranks)
            sizes = {r: len(self._sgl_lru[r]) for r in ranks}
        else:
            matches = {r: lengths[r] for r in ranks}
            sizes = {r: len(gbm.ranks[r].blocks) for r in ranks}
        best = min(ranks, key=lambda r: (-matches[r], loads[r], r))
        rate = matches[best] * gbm.block_size / query.num_prompt_tokens if query.num_prompt_tokens else 0.0
        if rate > cfg.sglang_cache_threshold:
            return best, f"sglang_cache r{best} rate={rate:.2f}"
        smallest = min(ranks, key=lambda r: (sizes[r], loads[r], r))
        return smallest, f"sglang_smallest_tree r{smallest} size={sizes[smallest]} rate={rate:.2f}"

    def _sgl_match(self, block_hashes: list[int], ranks: list[int]) -> dict[int, int]:
        remaining = sum(1 << r for r in ranks)
        matches = dict.fromkeys(ranks, 0)
        for i, h in enumerate(block_hashes):
            remaining &= self._sgl_tree.get(h, 0)
            if not remaining:
                break
            for r in ranks:
                if remaining >> r & 1:
                    matches[r] = i + 1
        return matches

    def _sgl_insert(self, rank: int, block_hashes: list[int]) -> None:
        bit = 1 << rank
        lru = self._sgl_lru[rank]
        for h in block_hashes:
            self._sgl_tree[h] = self._sgl_tree.get(h, 0) | bit
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.config.sglang_max_tree_blocks:
            h, _ = lru.popitem(last=False)
            mask = self._sgl_tree[h] & ~bit
            if mask:
                self._sgl_tree[h] = mask
            else:
                del self._sgl_tree[h]

    def _route_dynamo_kv(self, query: RouteQuery, ranks: list[int], lengths: list[int], seed: int | None):
        """NVIDIA Dynamo's KV router: ``cost = overlap_score_weight * prefill_blocks + decode_blocks``.

        Source: Dynamo docs, "KV Router" / "Routing Concepts" (cost calculation
        and worker selection), and ``DefaultWorkerSelector`` in its kv-router
        crate: defaults ``--kv-overlap-score-weight 1.0``, ``--router-temperature
        0.0`` (argmin; ties to the smaller cache tree, else random). With a
        temperature T > 0 the worker is sampled with probability proportional to
        ``exp(-(cost - min) / ((max - min) * T))`` (uniform when all costs tie).

        Here, per rank: ``prefill_blocks`` = (prompt tokens already waiting there,
        including reserved ones, + this prompt's tokens past its cached overlap)
        / block_size, with the overlap from the global page table (Dynamo's
        indexer is also built from worker KV events); ``decode_blocks`` = the
        rank's used blocks + reserved blocks + this prompt's blocks (Dynamo
        de-duplicates blocks shared with active sequences; we do not). Ties go
        to the smaller page-table share, then the lower rank, not at random.
        """
        cfg = self.config
        gbm = self.gbm
        block_size = gbm.block_size
        prompt_blocks = -(-query.num_prompt_tokens // block_size)
        costs = {}
        for r in ranks:
            info = gbm.ranks[r]
            new_prefill = max(0, query.num_prompt_tokens - lengths[r] * block_size)
            prefill_blocks = (info.load.waiting_prefill_tokens + info.reserved_tokens + new_prefill) / block_size
            decode_blocks = info.load.blocks_used + info.reserved_blocks + prompt_blocks
            costs[r] = cfg.dynamo_overlap_score_weight * prefill_blocks + decode_blocks
        if cfg.dynamo_temperature == 0.0:
            best = min(ranks, key=lambda r: (costs[r], gbm.ranks[r].num_ready, r))
            return best, f"dynamo_min_cost r{best} cost={costs[best]:.1f}"
        lo, hi = min(costs.values()), max(costs.values())
        if lo == hi:
            weights = [1.0] * len(ranks)
        else:
            scale = (hi - lo) * cfg.dynamo_temperature
            weights = [math.exp(-(costs[r] - lo) / scale) for r in ranks]
        best = self._rng.choices(ranks, weights)[0]
        return best, f"dynamo_sample r{best} cost={costs[best]:.1f} min={lo:.1f}"


def _describe(rule: str, c: RankCost) -> str:
    return f"{rule} r{c.rank} m{c.matched} cost={c.cost:.0f}"


def _request_shape(query: RouteQuery, matched: int, block_size: int) -> tuple[int, int, int]:
    """(usable matched blocks, prompt tokens to compute, new blocks to hold) on a rank matching ``matched``.

    The worker recomputes the last prompt token to get logits, so a fully cached
    prompt still computes its final block (``BlockManager.match_prefix``).
    """
    prompt = query.num_prompt_tokens
    m = min(matched, max(0, (prompt - 1) // block_size))
    need = max(0, -(-(prompt + query.max_tokens) // block_size) - m)
    return m, prompt - m * block_size, need
