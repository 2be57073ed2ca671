"""A control plane for route-time pull tests, in one process: the page table, the LMPool
router (fixed step times, ``control_testkit.COEF``), the transfer coordinator and ``RoutePulls``, with workers simulated by answering
each plan's orders by hand (``advance``), so a test decides when a pull progresses, fails or
loses a rank."""

from __future__ import annotations

import itertools

from control_testkit import COEF, ManualClock, chain_blocks, priced_router

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.topology import Topology
from lmpool.control.transfers.coordinator import TransferCoordinator
from lmpool.control.transfers.cost_model import TransferCostModel
from lmpool.control.transfers.pull import RoutePulls
from lmpool.control.transfers.pull_price import PullPricer
from lmpool.protocol import (
    DestPrepared,
    Executed,
    Finalized,
    LoadReport,
    PhaseFailed,
    PlanState,
    Published,
    RouteQuery,
    SourcePrepared,
)
from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot

BLOCK = 4
NUM_BLOCKS = 1000


class PullRig:
    def __init__(self, world: int = 2, *, coefficients=COEF, held: bool = True, config=None) -> None:
        """``held``: whether plan orders wait for a rank's step under way (CPU workers), or are
        served while it runs (CUDA workers under overlapped stepping); ``config``: the router's
        ``RoutingConfig``."""
        self.clock = ManualClock()
        self.gbm = GlobalBlockManager(world, BLOCK, clock=self.clock)
        topology = Topology.virtual(world)
        self.sent: list[tuple[int, object]] = []
        self.cost_model = TransferCostModel.uncalibrated(4096, 1e-3, 1e9)
        self.coordinator = TransferCoordinator(self.gbm, lambda r, m: self.sent.append((r, m)), clock=self.clock,
                                               cost_model=self.cost_model, on_end=self._ended,
                                               on_published=self._published)
        self.resolved: list[tuple[str, str]] = []
        self.router = priced_router(self.gbm, topology, config=config, coefficients=coefficients)
        pricer = PullPricer(self.gbm, topology, self.router.policy.pricer, self.cost_model.estimate,
                            self.coordinator.room, source_held=held, dest_held=held)
        self.pulls = RoutePulls(self.gbm, self.coordinator, pricer,
                                lambda rid, outcome: self.resolved.append((rid, outcome)))
        self.router.stages.insert(0, self.pulls)  # where ``make_router`` puts it
        self.epochs = [1] * world
        self._ids = itertools.count(10_000)
        self._requests = itertools.count()
        for r in range(world):
            self.gbm.register_rank(r, 1, NUM_BLOCKS)
            self.gbm.apply_snapshot(r, 1, KVSnapshot(1, []))

    def _published(self, plan) -> None:
        self.pulls.plan_published(plan)

    def _ended(self, plan) -> None:
        self.pulls.plan_ended(plan)

    # ---- the pool's state ------------------------------------------------------------------

    def cache(self, rank: int, hashes: list[int]) -> None:
        info = self.gbm.ranks[rank]
        self.gbm.apply_snapshot(rank, info.epoch, KVSnapshot(info.version + 1, chain_blocks(hashes, first_id=1)))

    def load(self, rank: int, running: int, decode_left: int = 0, context: int = 0,
             free: int = NUM_BLOCKS - 100) -> None:
        info = self.gbm.ranks[rank]
        self.gbm.update_load(rank, info.epoch, LoadReport(num_running=running, decode_tokens_left=decode_left,
                                                          context_tokens=context, blocks_free=free))

    def route(self, hashes: list[int], tail_tokens: int = 1, max_tokens: int = 64):
        query = RouteQuery(f"q{next(self._requests)}", hashes, len(hashes) * BLOCK + tail_tokens, max_tokens)
        decision = self.router.route(query)
        self.gbm.check_route(hashes, decision.rank, decision.matched_blocks)
        return query.request_id, decision

    def kill(self, rank: int) -> None:
        self.coordinator.rank_died(rank)
        self.router.rank_down(rank)

    def revive(self, rank: int) -> None:
        self.epochs[rank] += 1
        self.gbm.register_rank(rank, self.epochs[rank], NUM_BLOCKS)
        self.gbm.apply_snapshot(rank, self.epochs[rank], KVSnapshot(1, []))

    # ---- simulated workers ------------------------------------------------------------------

    def advance(self, plan_id: int) -> None:
        """Both ends answer the plan's current phase (the destination publishes its blocks)."""
        plan = self.coordinator.plans[plan_id]
        if plan.state is PlanState.PREPARING:
            n = len(plan.hashes)
            self.coordinator.on_ack(SourcePrepared(plan_id, plan.src, list(range(1, n + 1)), [[0] * BLOCK] * n))
            if plan_id in self.coordinator.plans:
                ids = [next(self._ids) for _ in range(n)]
                self.coordinator.on_ack(DestPrepared(plan_id, plan.dst, ids, [1] * n))
        elif plan.state is PlanState.EXECUTING:
            self.coordinator.on_ack(Executed(plan_id, plan.src))
            self.coordinator.on_ack(Executed(plan_id, plan.dst))
        elif plan.state is PlanState.PUBLISHING:
            self._store(plan.dst, plan.hashes, plan.parents, plan.dst_blocks)
            self.coordinator.on_ack(Published(plan_id, plan.dst))
        elif plan.state is PlanState.FINALIZING:
            self.coordinator.on_ack(Finalized(plan_id, plan.src))

    def fail(self, plan_id: int) -> None:
        plan = self.coordinator.plans[plan_id]
        self.coordinator.on_ack(PhaseFailed(plan_id, plan.dst, plan.state.value, "injected"))

    def finish(self, plan_id: int) -> None:
        while plan_id in self.coordinator.plans:
            self.advance(plan_id)

    def _store(self, rank: int, hashes: list[int], parents: list[int], block_ids: list[int]) -> None:
        info = self.gbm.ranks[rank]
        events = [BlockStored(h, p, b, 1) for h, p, b in zip(hashes, parents, block_ids)]
        self.gbm.apply_delta(rank, info.epoch, KVDelta(info.version, info.version + len(events), events))

    def check(self) -> None:
        self.gbm.check_invariants()
        self.pulls.check_invariants()
        # A waiting request's reserved work is deferred until its pull ends, and only it is.
        deferred = {k for k, r in self.gbm.reservations.items() if r.deferred}
        assert deferred == set(self.pulls.waiting) & set(self.gbm.reservations), "deferred work and waiters differ"
        if not self.coordinator.plans:
            assert not self.pulls.waiting and not self.pulls.open
            assert not any(info.in_flight for info in self.gbm.ranks), "an ended plan left blocks in flight"
