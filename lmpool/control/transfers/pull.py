"""Route-time pulls: send a request where it is cheapest to serve, copying its cached prefix there first.

After the routing policy has chosen, ``reprice`` prices every candidate's options
(``pull_price``): serve from its cache, recompute what it lacks, or pull the prefix from the
rank that holds most of it. If the cheapest option beats the policy's choice by at least
``min_gain_tokens``, it wins: a pull opens a copy plan (kind "pull") for the missing blocks to
that rank. A request routed to a rank that an open pull is bringing its prefix to waits for
that pull, however it was routed: concurrent requests needing the same blocks on the same rank
share one plan. The decision and its priced alternatives go into the route's reason.

A waiting request is released (``on_resolved(request_id, outcome)``) once its pull's
destination has published the blocks ("landed"), or once the plan aborts ("aborted: ...":
the request then runs on that rank and recomputes what did not land). The control plane
holds the request's route reply until then, so a worker never sees a request before its
blocks; the coordinator unmarks and the workers release everything an aborted plan held.

Invariants (``check_invariants``): every open pull is an open coordinator plan; one open pull
per (destination, first hash), indexed both ways; every waiting request waits on exactly one
open pull; a pull that ends or publishes releases all its waiters and leaves no index entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.cost import RankCost
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.pull_price import OpenPullView, Option, PullPricer, describe, shared_depth
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol import RouteQuery


@dataclass
class OpenPull:
    plan_id: int
    dst: int
    hashes: list[int]
    started: float
    estimate_s: float
    waiters: list[str] = field(default_factory=list)


@dataclass
class PullCounters:
    started: int = 0  # plans opened for pulls
    shared: int = 0  # requests that waited on a pull another request opened
    landed: int = 0  # pulls whose destination published
    aborted: int = 0  # pulls that ended before it did
    routed: int = 0  # requests sent where the policy would not have (pull or serve elsewhere)


class RoutePulls:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        coordinator: TransferCoordinator,
        pricer: PullPricer,
        on_resolved: Callable[[str, str], None],
        *,
        min_gain_tokens: float,
    ) -> None:
        self.gbm = gbm
        self.coordinator = coordinator
        self.pricer = pricer
        self.on_resolved = on_resolved
        self.min_gain_tokens = min_gain_tokens
        self.open: dict[int, OpenPull] = {}  # by plan id
        self._by_head: dict[tuple[int, int], OpenPull] = {}  # (destination, first hash) -> its pull
        self.waiting: dict[str, int] = {}  # request id -> the plan it waits on
        self.counters = PullCounters()

    # ---- routing -------------------------------------------------------------------------

    def reprice(self, query: RouteQuery, costs: list[RankCost], lengths: list[int], expected: list[int],
                rank: int, reason: str) -> tuple[int, str, list[int]]:
        """The rank for ``query`` once pulls are priced, the route's reason, and the blocks each
        rank will hold for it (the chosen rank's raised by the pull it waits on)."""
        if query.request_id in self.waiting:  # one wait per request id (ids are per dispatch)
            return rank, reason, expected
        feasible = {c.rank for c in costs if c.available >= c.need}
        options = self.pricer.options(query, costs, lengths, expected, self._view,
                                      lambda serve: self._bound(serve, rank, feasible))
        if not options:
            return rank, reason, expected
        policy = next(o for o in options if o.kind == "serve" and o.rank == rank)
        chosen = self._choose(options, policy, feasible)
        if chosen is not policy:
            self.counters.routed += 1
            reason = f"{_name(chosen)} over {reason}"
        reason = f"{reason}; {describe(options)}"
        held = self._wait(query, chosen, lengths)
        if held <= expected[chosen.rank]:
            return chosen.rank, reason, expected
        raised = list(expected)
        raised[chosen.rank] = held
        return chosen.rank, reason, raised

    def _bound(self, serve: list[Option], rank: int, feasible: set[int]) -> float:
        """What a pull must cost less than to win: the cheapest feasible serve, and the
        policy's choice (``rank``) less the minimum gain."""
        policy = next(o.cost for o in serve if o.rank == rank)
        return min([o.cost for o in serve if o.rank in feasible] + [policy - self.min_gain_tokens])

    def _choose(self, options: list[Option], policy: Option, feasible: set[int]) -> Option:
        """The cheapest option (serving before pulling, on a tie), if it beats the policy's
        choice by ``min_gain_tokens``; else the policy's. A serve must fit on its rank."""
        best = min((o for o in options if o.rank in feasible or o.kind == "pull"),
                   key=lambda o: (o.cost, o.kind != "serve", o.rank), default=policy)
        return best if best.cost < policy.cost - self.min_gain_tokens else policy

    def _wait(self, query: RouteQuery, chosen: Option, lengths: list[int]) -> int:
        """Start or join the pull the request waits on (if any); the blocks it will find."""
        hashes, rank = query.block_hashes, chosen.rank
        m = lengths[rank]
        if chosen.kind == "pull" and not chosen.shared:
            pull = self._start(hashes, chosen.src, rank, m, chosen.blocks, chosen.copy_s)
            depth = chosen.blocks
        else:
            pull = self._by_head.get((rank, hashes[m])) if m < len(hashes) else None
            if pull is None:
                return m
            depth = shared_depth(pull.hashes, hashes, m, len(hashes))
            self.counters.shared += 1
        pull.waiters.append(query.request_id)
        self.waiting[query.request_id] = pull.plan_id
        return m + depth

    def _start(self, hashes: list[int], src: int, dst: int, start: int, blocks: int, seconds: float) -> OpenPull:
        chain = hashes[start:start + blocks]
        held = self.gbm.ranks[src].blocks  # hash -> generation << 32 | block id; all ready (priced so)
        generations = [held[h] >> 32 for h in chain]
        parent = hashes[start - 1] if start else ROOT_HASH
        anchor = (parent, self.gbm.generation(dst, parent)) if start else (ROOT_HASH, 0)
        plan = self.coordinator.start(src, dst, chain, generations, [parent] + chain[:-1], kind="pull", anchor=anchor)
        pull = OpenPull(plan.plan_id, dst, chain, plan.started, seconds)
        self.open[plan.plan_id] = pull
        self._by_head[(dst, chain[0])] = pull
        self.counters.started += 1
        return pull

    def _view(self, dst: int, first_hash: int) -> OpenPullView | None:
        pull = self._by_head.get((dst, first_hash))
        if pull is None:
            return None
        left = max(0.0, pull.estimate_s - (self.coordinator.clock() - pull.started))
        return OpenPullView(pull.plan_id, pull.hashes, left)

    # ---- plan outcomes -------------------------------------------------------------------

    def plan_published(self, plan: Plan) -> None:
        """The destination holds the blocks: their requests may run."""
        if plan.plan_id in self.open:
            self.counters.landed += 1
            self._resolve(plan.plan_id, "landed")

    def plan_ended(self, plan: Plan) -> None:
        """A plan ended; one still open here aborted before it published."""
        if plan.plan_id in self.open:
            self.counters.aborted += 1
            self._resolve(plan.plan_id, f"aborted: {plan.abort_reason}")

    def _resolve(self, plan_id: int, outcome: str) -> None:
        pull = self.open.pop(plan_id)
        del self._by_head[(pull.dst, pull.hashes[0])]
        for request_id in pull.waiters:
            del self.waiting[request_id]
        for request_id in pull.waiters:
            self.on_resolved(request_id, outcome)

    def check_invariants(self) -> None:
        for plan_id, pull in self.open.items():
            plan = self.coordinator.plans.get(plan_id)
            assert plan is not None and plan.kind == "pull", f"open pull {plan_id} is not an open pull plan"
            assert self._by_head.get((pull.dst, pull.hashes[0])) is pull, f"pull {plan_id} is not indexed"
            for request_id in pull.waiters:
                assert self.waiting.get(request_id) == plan_id, f"{request_id} is not waiting on {plan_id}"
        assert len(self._by_head) == len(self.open), "an index entry names no open pull"
        assert sum(len(p.waiters) for p in self.open.values()) == len(self.waiting), "a waiter waits on no pull"


def _name(o: Option) -> str:
    if o.kind == "serve":
        return f"serve r{o.rank} cost={o.cost:.0f}"
    source = "shared" if o.shared else f"r{o.src}"
    return f"pull r{o.rank}<-{source} {o.blocks}b copy={o.copy_tokens:.0f} cost={o.cost:.0f}"
