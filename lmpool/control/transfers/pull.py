"""Route-time pulls: send a request where it is cheapest to serve, copying its cached prefix there first.

A route stage. Once the routing policy has chosen, and only where it lets the request leave
its rank (an overloaded owner, or no owner: ``Choice.may_leave``), ``settle`` prices a pull to
every candidate that could take one (``pull_price``); the cheapest (``pricing.price.cheapest``) wins if it costs
less than the policy's choice, and a copy plan (kind "pull") for the missing blocks to that rank opens as
the route is recorded (``record``: right after the decision, always before the next; the request's
reply waits for the copy, not for the plan's opening, so the decision ends with the choice).
A request routed to a rank that an open pull is bringing its prefix to waits for that pull,
however it was routed: concurrent requests needing the same blocks on the same rank share
one plan. Before the policy chooses, ``expect`` counts an open pull's blocks as its
destination's, landing in the seconds it has left, so the policy prices them. The route's
reason names the pull and its priced alternatives.

A pull moves what only one conversation used: the blocks past the deepest one that routed
prompts branched from (``HashStats.branched``) leave the source (the source frees those
that nothing there references); the rest, shared, is copied.

A waiting request is released (``on_resolved(request_id, outcome)``) once its pull's
destination has published the blocks ("landed"), or once the plan aborts ("aborted: ...":
the request then runs on that rank and recomputes what did not land). Until then its
reservation there is deferred (``Route.waits_on_pull``): priced as work that starts only once
the pull ends. The control plane
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
from lmpool.control.pricing.price import cheapest
from lmpool.control.routing.route import Route, RouteStage
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.pull_price import PullOption, PullPricer, describe, shared_depth
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.base import BlockHash


@dataclass
class OpenPull:
    plan_id: int
    dst: int
    hashes: list[bytes]
    started: float
    estimate_s: float
    waiters: list[str] = field(default_factory=list)


@dataclass
class PullCounters:
    started: int = 0  # plans opened for pulls
    moved: int = 0  # ... of which moved some blocks (freed on their source)
    shared: int = 0  # requests that waited on a pull another request opened
    landed: int = 0  # pulls whose destination published
    aborted: int = 0  # pulls that ended before it did
    routed: int = 0  # requests a pull sent elsewhere than the routing policy chose


class RoutePulls(RouteStage):
    def __init__(self, gbm: GlobalBlockManager, coordinator: TransferCoordinator, pricer: PullPricer,
                 on_resolved: Callable[[str, str], None], price_tie: float = 0.0) -> None:
        self.gbm = gbm
        self.price_tie = price_tie  # prices this close are equal (``pricing.price.cheapest``)
        self.coordinator = coordinator
        self.pricer = pricer
        self.on_resolved = on_resolved
        self.open: dict[int, OpenPull] = {}  # by plan id
        self._by_head: dict[tuple[int, bytes], OpenPull] = {}  # (destination, first hash) -> its pull
        self.waiting: dict[str, int] = {}  # request id -> the plan it waits on
        self._opening: tuple[Route, PullOption] | None = None  # the last route's pull, opened as it is recorded
        self.counters = PullCounters()

    # ---- routing -------------------------------------------------------------------------

    def expect(self, route: Route) -> None:
        if not self.open:
            return
        hashes, ready, by_head = route.query.block_hashes, route.ready, self._by_head
        n = len(hashes)
        for r in route.ranks:  # ``_pull_to`` inlined: every route runs this while any pull is open
            m = ready[r]
            pull = by_head.get((r, hashes[m])) if m < n else None
            if pull is not None:
                depth = shared_depth(pull.hashes, hashes, m, n)
                route.expected[r] = max(route.expected[r], m + depth)
                route.waits[r] = max(0.0, pull.estimate_s - (self.coordinator.clock() - pull.started))

    def settle(self, route: Route) -> None:
        self._opening = None  # a decision that failed after its pull was chosen was never recorded
        if route.query.request_id in self.waiting:  # one wait per request id: it still waits on its pull
            route.waits_on_pull = True
            return
        if route.prices is None:
            return
        if route.may_leave and self._pull(route):
            return
        rank, m, hashes = route.rank, route.ready[route.rank], route.query.block_hashes
        pull = self._pull_to(rank, hashes, m)
        if pull is not None:  # however it was routed, it waits for the blocks coming there
            self._wait(route.query.request_id, pull)
            route.waits_on_pull = True
            self.counters.shared += 1
            route.expected[rank] = max(route.expected[rank], m + shared_depth(pull.hashes, hashes, m, len(hashes)))

    def _pull(self, route: Route) -> bool:
        """Start the cheapest pull if it costs less than the policy's choice; whether it did."""
        options = self.pricer.options(route)
        if not options:
            return False
        described = [describe(o) for o in options]  # each option's text, the winner's written twice
        alternatives = "; pull " + " ".join(described)
        winner = cheapest([o.price for o in options], self.price_tie)
        at = next(i for i, o in enumerate(options) if o.price is winner)
        best = options[at]
        if route.chosen is None or best.price.total_s >= route.chosen.total_s:
            route.reason += alternatives
            return False
        self._opening = (route, best)
        route.waits_on_pull = True
        # Its own price's parts first: the record's reader takes the first (the owner's follow "over").
        route.reason = (f"pull {described[at]} copy={best.copy_s * 1e3:.1f}ms busy={best.price.busy_s * 1e3:.1f}ms "
                        f"own={best.price.own_s * 1e3:.1f}ms over {route.reason}{alternatives}")
        route.rank, route.chosen = best.price.rank, best.price
        route.expected[route.rank] = best.start + best.blocks
        self.counters.routed += 1
        return True

    def record(self, route: Route) -> None:
        """Open the pull ``route`` was decided to wait on, if any: its plan, its waiter."""
        if self._opening is None or self._opening[0] is not route:
            return
        option = self._opening[1]
        self._opening = None
        self._wait(route.query.request_id, self._start(route.query.block_hashes, option))

    def waits(self, request_id: str) -> bool:
        """Whether ``request_id``'s route waits on a pull: one it shares, or the one it opens
        as it is recorded."""
        opening = self._opening
        return request_id in self.waiting or (opening is not None and opening[0].query.request_id == request_id)

    def _pull_to(self, rank: int, hashes: list[bytes], m: int) -> OpenPull | None:
        """The open pull bringing ``hashes``' block ``m`` (rank's first missing one) to ``rank``."""
        return self._by_head.get((rank, hashes[m])) if m < len(hashes) else None

    def _wait(self, request_id: str, pull: OpenPull) -> None:
        pull.waiters.append(request_id)
        self.waiting[request_id] = pull.plan_id

    def _start(self, hashes: list[bytes], option: PullOption) -> OpenPull:
        start, src, dst = option.start, option.src, option.price.rank
        chain = hashes[start:start + option.blocks]
        held = self.gbm.ranks[src].blocks  # hash -> generation << 32 | block id; all ready (priced so)
        generations = [held[h] >> 32 for h in chain]
        parent = hashes[start - 1] if start else ROOT_HASH
        anchor: tuple[BlockHash, int] = (ROOT_HASH, 0)
        if start:
            generation = self.gbm.generation(dst, parent)
            assert generation is not None  # the pull starts just past the blocks dst holds ready
            anchor = (parent, generation)
        keep = self.gbm.branched_depth(chain)  # the leading blocks others share: copied, not moved
        plan = self.coordinator.start(src, dst, chain, generations, [parent] + chain[:-1], move=keep < len(chain),
                                      keep=keep, kind="pull", anchor=anchor, steps_s=option.steps_s)
        pull = OpenPull(plan.plan_id, dst, chain, plan.started, option.copy_s)
        self.open[plan.plan_id] = pull
        self._by_head[(dst, chain[0])] = pull
        self.counters.started += 1
        self.counters.moved += keep < len(chain)
        return pull

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
            self.gbm.admissible(request_id)  # its reserved work may start now
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
