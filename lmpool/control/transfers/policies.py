"""The control process's automatic KV transfers: background placement and foreground release.

It owns the admission gate and its cost model (a calibration profile, or an
uncalibrated link model; either corrected online by every completed plan), the
placement leases that routing consults, and the bookkeeping that ties each plan
the coordinator runs back to the policy that asked for it:

- ``tick(budget_s)`` (a control-plane task, periodic and after routes) runs a
  ``BackgroundPlacement`` pass in slices and, as it ends, starts one plan per batch that
  still passes the gates; when a batch's plan completes, each of its chains gets a
  placement lease;
- ``pulls`` (``lmpool.control.transfers.pull``, built with the router), with ``transfer_mode``
  "pull" or "all": routing prices pulling a request's prefix to each candidate; every plan
  that publishes or ends is passed on to it, so a pull's waiters hear its outcome;
- ``on_shortage(report)`` answers a worker's ``ShortageReport`` with a move
  (``lmpool.control.transfers.foreground.plan_release``) or at once with a refusal; when the
  move's plan ends, the worker hears its outcome (``ReleaseOutcome``), so it never
  waits on a plan that is over.

Everything runs on the control loop; nothing here blocks or awaits. ``stats()``
returns the counters (``TransferStats``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lmpool.config.transfer import DEFAULT_PREFILL_S_PER_TOKEN
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Pricer
from lmpool.control.topology import Topology
from lmpool.control.transfers.admission import AdmissionGate, AdmissionPolicy
from lmpool.control.transfers.coordinator import Plan, PlanState, TransferCoordinator
from lmpool.control.transfers.foreground import plan_release
from lmpool.control.transfers.leases import SteerToLeases
from lmpool.control.transfers.placement import BackgroundPlacement, CopyBatch, HotChains, PlacementPass
from lmpool.control.transfers.pull import RoutePulls
from lmpool.protocol import ReleaseOutcome, ShortageReport, TransferStats
from lmpool.protocol.spec import ControlSpec

log = logging.getLogger("lmpool.control.transfers.policies")


class TransferPolicies:
    def __init__(
        self,
        spec: ControlSpec,
        gbm: GlobalBlockManager,
        topology: Topology,
        pricer: Pricer,
        coordinator: TransferCoordinator,
        send: Callable[[int, object], None],
        steering: SteerToLeases | None = None,
        pulls: RoutePulls | None = None,
        chains: HotChains | None = None,
    ) -> None:
        transfer = spec.pool.transfer
        cfg = transfer.transfer_policy
        self.cfg = cfg
        self.gbm = gbm
        self.topology = topology
        self.pricer = pricer
        self.coordinator = coordinator
        self.send = send
        self.background = transfer.background_placement
        self.foreground = transfer.foreground_release
        assert coordinator.cost_model is not None  # build_control_plane gives the coordinator one
        self.cost_model = coordinator.cost_model  # completed plans correct the estimates
        policy = AdmissionPolicy(
            prefill_s_per_token=cfg.prefill_s_per_token or DEFAULT_PREFILL_S_PER_TOKEN,
            block_size=spec.pool.engine.block_size, discount=cfg.reuse_discount, margin=cfg.admission_margin,
        )
        self.gate = AdmissionGate(policy, self.cost_model)
        self.steering = steering  # the router's lease stage: background copies grant its leases
        self.leases = steering.leases if steering is not None else None
        self.placement: BackgroundPlacement | None = None
        if self.background:
            if steering is None or chains is None:
                raise ValueError("background placement needs the router's lease stage and routed chains")
            self.placement = BackgroundPlacement(
                gbm, topology, pricer.load_s, coordinator, self.gate, self.prefill_s_per_token, chains,
                hot_threshold=cfg.hot_threshold, min_load_skew_s=cfg.min_load_skew_s,
                cooldown_s=cfg.cooldown_s, max_blocks=transfer.background_copy_max_blocks,
                batch_max_blocks=transfer.background_copy_batch_max_blocks,
            )
        self.pulls = pulls
        self.copies: dict[int, CopyBatch] = {}  # open background plans
        self._pass: PlacementPass | None = None  # the placement pass under way, between slices
        self.releases: dict[int, tuple[int, int]] = {}  # open foreground plans -> (rank, release id)
        self.stats_ = TransferStats()

    # ---- inputs ------------------------------------------------------------------------

    def prefill_s_per_token(self, rank: int) -> float:
        """What a token of prefill costs on ``rank``: the configured figure, else the rank's fitted one."""
        if self.cfg.prefill_s_per_token is not None:
            return self.cfg.prefill_s_per_token
        return self.pricer.prefill_s_per_token(rank)

    # ---- background ----------------------------------------------------------------------

    def tick(self, budget_s: float | None = None, fresh_only: bool = False) -> bool:
        """Run the open placement pass (starting one, over the chains routed since the last if
        ``fresh_only``, if none is open) for ``budget_s`` seconds at most past one step (None: to
        its end): its chains, then its copies, each started if it still passes the gates as they
        are now. True once the pass is over."""
        if self.placement is None:
            return True
        assert self.leases is not None  # background placement runs with the lease stage
        if self._pass is None:
            self.leases.expire()
            self.stats_.background_ticks += 1
            self._pass = self.placement.start_pass(fresh_only)
            if budget_s is not None:
                return False  # starting is a slice of its own: it copies the list of chains
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        if not self._pass.run(budget_s):
            return False
        while (batch := self._pass.next_copy()) is not None:
            self._start_copy(batch)
            if deadline is not None and time.perf_counter() >= deadline:
                return False
        self._pass = None
        return True

    def _start_copy(self, batch: CopyBatch) -> None:
        assert self.placement is not None  # batches come from its passes
        reason = self.placement.stale(batch, 0)  # the coordinator counts the copies started so far
        if reason:
            self.placement.refused[reason] += 1
            return
        plan = self.coordinator.start(batch.src, batch.dst, batch.hashes, batch.generations, batch.parents,
                                      kind="background")
        self.copies[plan.plan_id] = batch

    def drop_pass(self) -> None:
        """Forget a pass that failed part-way; the next tick starts afresh."""
        self._pass = None

    # ---- foreground ----------------------------------------------------------------------

    def on_shortage(self, report: ShortageReport) -> None:
        self.stats_.foreground_requests += 1
        info = self.gbm.ranks[report.rank] if 0 <= report.rank < self.gbm.world_size else None
        if not self.foreground or info is None or not info.alive or info.epoch != report.epoch:
            self._refuse(report, "foreground release is off, or the report is from a past incarnation")
            return
        try:
            plan, reason = plan_release(report, self.gbm, self.topology.partners(report.rank),
                                        self.coordinator.free_blocks, self.gate, self.prefill_s_per_token)
        except ValueError as e:
            plan, reason = None, str(e)
        if plan is None:
            self._refuse(report, reason)
            return
        started = self.coordinator.start(plan.src, plan.dst, plan.hashes, plan.generations, plan.parents,
                                         move=True, keep=plan.keep, kind="foreground")
        self.releases[started.plan_id] = (report.rank, report.release_id)

    def _refuse(self, report: ShortageReport, reason: str) -> None:
        self.stats_.foreground_refused += 1
        log.info("rank %d: no foreground move for %d blocks: %s", report.rank, report.num_victims, reason)
        self.send(report.rank, ReleaseOutcome(report.release_id, "refused", reason))

    # ---- plan outcomes -------------------------------------------------------------------

    def plan_published(self, plan: Plan) -> None:
        if self.pulls is not None:
            self.pulls.plan_published(plan)

    def plan_ended(self, plan: Plan) -> None:
        if self.pulls is not None:
            self.pulls.plan_ended(plan)
        done = plan.state is PlanState.DONE
        batch = self.copies.pop(plan.plan_id, None)
        if batch is not None and done:
            self.stats_.background_copies += 1
            self.stats_.background_blocks += len(plan.hashes)
            assert self.leases is not None  # a background copy's batch: placement runs with leases
            for leaf, depth in batch.leases:
                self.leases.grant(leaf, depth, plan.src, plan.dst)
        release = self.releases.pop(plan.plan_id, None)
        if release is not None:
            rank, release_id = release
            if done:
                self.stats_.foreground_moves += 1
            else:
                self.stats_.foreground_failed += 1
            self.send(rank, ReleaseOutcome(release_id, "done" if done else "aborted", plan.abort_reason))

    def stats(self) -> TransferStats:
        s, c = self.stats_, self.coordinator
        s.plans_started, s.plans_committed, s.plans_aborted = c.started, c.completed, c.aborted
        s.plans_open = len(c.plans)
        s.blocks_copied, s.blocks_moved = c.blocks_copied, c.blocks_moved
        s.lease_routed = self.steering.routed if self.steering is not None else 0
        s.leases = len(self.leases) if self.leases is not None else 0
        s.admission_admitted, s.admission_refused = self.gate.admitted, self.gate.refused
        s.placement_refused = dict(self.placement.refused) if self.placement is not None else {}
        s.in_flight_blocks = sum(len(i.in_flight) for i in self.gbm.ranks)
        s.reservations = len(self.gbm.reservations)
        s.plan_phases_ms = c.phase_times.summary()
        if self.pulls is not None:
            p = self.pulls.counters
            s.pulls_started, s.pulls_shared, s.pulls_landed, s.pulls_moved = p.started, p.shared, p.landed, p.moved
            s.pulls_aborted, s.pulls_routed, s.pulls_open = p.aborted, p.routed, len(self.pulls.open)
        return s

