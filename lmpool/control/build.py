"""The one place that builds a control process: every collaborator is made here and handed to
the objects that use it through their constructors, so no object sets another's attributes.

Order: topology and page table; the transfer cost model (calibrated, or an uncalibrated link
model its completed plans correct); the per-rank outbox; the coordinator; route-time pulls when
they run (they price with the coordinator's cost model and room, and the router consults them);
the router (with its placement leases when background placement runs); the transfer policies;
the control plane, which the coordinator tells of every plan that publishes or ends, and the
pulls of every waiting route they release.
"""

from __future__ import annotations

import random

from lmpool.config.transfer import DEFAULT_PREFILL_S_PER_TOKEN, UNCALIBRATED_LINK
from lmpool.control.plane import ControlPlane, Outbox
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.router import Router
from lmpool.control.topology import Topology
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.cost_model import TransferCostModel
from lmpool.control.transfers.leases import PlacementLeases
from lmpool.control.transfers.policies import TransferPolicies, prefill_s_per_token
from lmpool.control.transfers.pull import RoutePulls
from lmpool.control.transfers.pull_price import PullPricer
from lmpool.protocol.spec import ControlSpec


def build_control_plane(spec: ControlSpec) -> ControlPlane:
    pool = spec.pool
    policy = pool.transfer.transfer_policy
    gbm = GlobalBlockManager(pool.world_size, pool.engine.block_size, heat_half_life_s=policy.heat_half_life_s,
                             route_hit_weight=policy.route_hit_weight,
                             reservation_ttl_s=pool.routing_config.reservation_ttl_s)
    # Placement leases steer routes to background placement's copies.
    leases = PlacementLeases(policy.lease_s, clock=gbm.clock) if pool.transfer.background_placement else None
    links = topology(spec)
    outbox = Outbox()
    plane: ControlPlane | None = None

    # Bound late: the plane is made last, from the others.
    def plan_ended(plan: Plan) -> None:
        plane.plan_ended(plan)

    def plan_published(plan: Plan) -> None:
        plane.plan_published(plan)

    def pull_resolved(request_id: str, outcome: str) -> None:
        plane.pull_resolved(request_id, outcome)

    # A restarted control process must not reuse the plan ids its predecessor's plans hold on
    # the workers, hence a random start.
    coordinator = TransferCoordinator(gbm, outbox.send, cost_model=cost_model(spec), on_end=plan_ended,
                                      first_plan_id=random.getrandbits(48), on_published=plan_published)
    pulls = route_pulls(spec, gbm, links, coordinator, pull_resolved) if pool.transfer.route_pulls else None
    router = Router(gbm, links, policy=pool.routing, config=pool.routing_config, leases=leases, pulls=pulls)
    policies = TransferPolicies(spec, gbm, router, coordinator, outbox.send, pulls=pulls)
    plane = ControlPlane(spec, gbm, router, coordinator, policies, outbox)
    return plane


def route_pulls(spec: ControlSpec, gbm: GlobalBlockManager, links: Topology, coordinator: TransferCoordinator,
                on_resolved) -> RoutePulls:
    """Route-time pulls, priced with the coordinator's (corrected) cost model and room."""
    cfg = spec.pool.transfer.transfer_policy
    fallback = cfg.prefill_s_per_token or DEFAULT_PREFILL_S_PER_TOKEN

    def per_token(rank: int) -> float:  # never None: pricing a pull converts seconds to tokens
        return prefill_s_per_token(cfg, gbm, rank) or fallback

    pricer = PullPricer(gbm, links, coordinator.cost_model.estimate, per_token, coordinator.room,
                        contention_weight=cfg.decode_contention_weight)
    return RoutePulls(gbm, coordinator, pricer, on_resolved, min_gain_tokens=cfg.pull_min_gain_tokens)


def topology(spec: ControlSpec) -> Topology:
    pool = spec.pool
    if pool.topology is None:
        return Topology.detect(pool.world_size, pool.device, spec.gpu_of_rank)
    return Topology.from_pairs(pool.world_size, [tuple(p) for p in pool.topology], spec.gpu_of_rank)


def cost_model(spec: ControlSpec) -> TransferCostModel:
    """The transfer cost model: the calibration profile's, or a plain link model for the pool's
    device kind; completed plans correct either online."""
    kv_bytes = max(1, spec.kv_bytes_per_block)
    profile = spec.pool.transfer.transfer_policy.transfer_profile
    if profile is not None:
        return TransferCostModel.from_profile(profile, kv_bytes)
    fixed_s, bytes_per_s = UNCALIBRATED_LINK["cuda" if spec.pool.device == "cuda" else "cpu"]
    return TransferCostModel.uncalibrated(kv_bytes, fixed_s, bytes_per_s)
