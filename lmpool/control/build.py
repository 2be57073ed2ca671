"""The one place that builds a control process: every collaborator is made here and handed to
the objects that use it through their constructors, so no object sets another's attributes.

Order: topology and page table; the router (with its placement leases when background placement
runs); the transfer cost model (calibrated, or an uncalibrated link model its completed plans
correct); the per-rank outbox; the coordinator; the transfer policies; the control plane, which
the coordinator tells of every plan that ends.
"""

from __future__ import annotations

import random

from lmpool.config.transfer import UNCALIBRATED_LINK
from lmpool.control.plane import ControlPlane, Outbox
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.router import Router
from lmpool.control.topology import Topology
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.cost_model import TransferCostModel
from lmpool.control.transfers.leases import PlacementLeases
from lmpool.control.transfers.policies import TransferPolicies
from lmpool.protocol.spec import ControlSpec


def build_control_plane(spec: ControlSpec) -> ControlPlane:
    pool = spec.pool
    policy = pool.transfer.transfer_policy
    gbm = GlobalBlockManager(pool.world_size, pool.engine.block_size, heat_half_life_s=policy.heat_half_life_s,
                             route_hit_weight=policy.route_hit_weight,
                             reservation_ttl_s=pool.routing_config.reservation_ttl_s)
    # Placement leases steer routes to background placement's copies.
    leases = PlacementLeases(policy.lease_s, clock=gbm.clock) if pool.transfer.background_placement else None
    router = Router(gbm, topology(spec), policy=pool.routing, config=pool.routing_config, leases=leases)
    outbox = Outbox()
    plane: ControlPlane | None = None

    def plan_ended(plan: Plan) -> None:  # bound late: the plane is made last, from the others
        plane.plan_ended(plan)

    # A restarted control process must not reuse the plan ids its predecessor's plans hold on
    # the workers, hence a random start.
    coordinator = TransferCoordinator(gbm, outbox.send, cost_model=cost_model(spec), on_end=plan_ended,
                                      first_plan_id=random.getrandbits(48))
    policies = TransferPolicies(spec, gbm, router, coordinator, outbox.send)
    plane = ControlPlane(spec, gbm, router, coordinator, policies, outbox)
    return plane


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
