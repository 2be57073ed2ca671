"""The router: picks the rank for a new request with one routing policy (``registry.POLICIES``).

``route_sequence_meta`` takes the candidates (alive ranks, within the seed's NVLink group when
a seed is given, else every alive rank), matches the prompt in the page table, lets the policy
choose, and then does what every policy shares, so comparisons isolate the rule:

- pending prefixes, for a policy that ``counts_pending`` while ``pending_ttl_s`` > 0: each
  rank's match also counts the blocks of prompts routed there and not reported yet
  (``lmpool.control.routing.pending``);
- placement leases, when background placement runs: if the prompt contains a leased chain
  that the lease's rank still holds, and that rank is a candidate, capacity-feasible and
  cheaper in the LMPool cost model than the chosen rank, it gets the request ("lease ... over
  ..."; counted in ``lease_routed``);
- a reservation on the chosen rank: the prompt tokens it must still compute, and the new
  blocks the request needs there capped at what the rank has left, so reservations never
  promise capacity a rank did not report;
- the prompt's demand, recorded in the page table's heat.

Route-time pulls (``lmpool.control.transfers.pull``), when they run, reprice the LMPool
policy's choice after the leases: serve, recompute or pull the prefix first, per candidate.

The decision reports only ready blocks: pending ones never count in ``matched_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmpool.config.routing import RoutingConfig
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.cost import CostModel, describe, request_shape
from lmpool.control.routing.lmpool import LMPoolPolicy
from lmpool.control.routing.pending import PendingPrefixes
from lmpool.control.routing.registry import POLICIES
from lmpool.control.topology import Topology
from lmpool.control.transfers.leases import PlacementLeases
from lmpool.protocol import RouteDecision, RouteQuery

if TYPE_CHECKING:  # pull pricing imports the router's cost terms: no import at run time
    from lmpool.control.transfers.pull import RoutePulls


class NoAliveRankError(RuntimeError):
    """Every rank is down: there is nowhere to route."""


class Router:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        topology: Topology,
        policy: str = "lmpool",
        config: RoutingConfig | None = None,
        leases: PlacementLeases | None = None,
        pulls: RoutePulls | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if topology.world_size != gbm.world_size:
            raise ValueError(f"topology has {topology.world_size} ranks, the page table {gbm.world_size}")
        self.gbm = gbm
        self.topology = topology
        self.config = config or RoutingConfig()
        self.costs = CostModel(gbm, topology, self.config)
        self.policy = POLICIES[policy](gbm, self.config, self.costs)
        self.leases = leases  # when background placement runs
        self.lease_routed = 0
        # Route-time pulls reprice only the LMPool policy's choice: it alone projects costs.
        self.pulls = pulls if isinstance(self.policy, LMPoolPolicy) else None
        self.last_held = 0  # blocks of the latest routed prompt cached on some candidate rank
        self.pending: PendingPrefixes | None = None
        if self.policy.counts_pending and self.config.pending_ttl_s > 0:
            self.pending = PendingPrefixes(gbm.world_size, self.config.pending_ttl_s, gbm.clock)
            gbm.watch_stored(self.pending.confirm)

    def route_sequence_meta(self, query: RouteQuery, seed_rank: int | None = None) -> RouteDecision:
        """Choose a rank for ``query``, reserve capacity there, and say why."""
        gbm = self.gbm
        gbm.expire_reservations()
        candidates = self._candidates(seed_rank)
        ranks = [r for r in range(gbm.world_size) if candidates >> r & 1]
        lengths = gbm.prefix_match(query.block_hashes, candidates)  # ready blocks: what the decision reports
        expected = self._expected(query, candidates, lengths)  # ... and what each rank will hold by then
        rank, reason = self.policy.choose(query, ranks, expected, seed_rank)
        if self.leases:
            rank, reason = self._steer(query, candidates, lengths, expected, seed_rank, rank, reason)
        if self.pulls is not None:
            rank, reason, expected = self.pulls.reprice(query, self.policy.last_costs, lengths, expected, rank, reason)
        self._reserve(query, rank, expected[rank])
        if self.pending is not None:
            self.pending.add(rank, query.block_hashes[lengths[rank]:])
        self.last_held = max(lengths)
        gbm.record_route(query.block_hashes, self.last_held, lengths[rank])
        self.policy.routed(query, rank)
        return RouteDecision(rank, lengths[rank], reason)

    def rank_down(self, rank: int) -> None:
        """``rank`` died: the page table forgets it, and nothing routed there will be computed."""
        self.gbm.mark_dead(rank)
        if self.pending is not None:
            self.pending.drop_rank(rank)

    def rank_load(self, rank: int) -> float:
        """Work already queued on ``rank``, in token-equivalents (the cost model's load term)."""
        return self.costs.load(rank)

    def _candidates(self, seed: int | None) -> int:
        candidates = self.topology.candidate_mask(seed) & self.gbm.alive_mask
        if candidates:
            return candidates
        # The seed's whole NVLink group is down: serving elsewhere beats failing the request.
        if not self.gbm.alive_mask:
            # The query's id is the pool's internal dispatch id: the pool names the
            # caller's request when it passes this on.
            raise NoAliveRankError("no alive rank to route the request to")
        return self.gbm.alive_mask

    def _expected(self, query: RouteQuery, candidates: int, lengths: list[int]) -> list[int]:
        """Each rank's matched blocks when the request runs there: ready, then pending."""
        if self.pending is None:
            return lengths
        return [self.pending.extend(r, query.block_hashes, n) if candidates >> r & 1 else n
                for r, n in enumerate(lengths)]

    def _steer(self, query: RouteQuery, candidates: int, lengths: list[int], expected: list[int],
               seed: int | None, rank: int, reason: str) -> tuple[int, str]:
        """Send the request to a placement lease's copy when that is cheaper (module docstring)."""
        lease = self.leases.find(query.block_hashes)
        if lease is None or lease.dst == rank or not candidates >> lease.dst & 1:
            return rank, reason
        if lengths[lease.dst] < lease.depth:  # the copy is gone: so is the lease's point
            self.leases.drop(lease.leaf)
            return rank, reason
        chosen, copy = self.costs.project(query, [rank, lease.dst], expected, seed)
        if not copy.feasible or copy.cost >= chosen.cost:
            return rank, reason
        self.lease_routed += 1
        return copy.rank, f"{describe('lease', copy)} over {reason}"

    def _reserve(self, query: RouteQuery, rank: int, matched: int) -> None:
        _, missing, need = request_shape(query, matched, self.gbm.block_size)
        blocks = min(need, max(0, self.gbm.ranks[rank].blocks_available))
        self.gbm.reserve(query.request_id, rank, blocks, missing)
