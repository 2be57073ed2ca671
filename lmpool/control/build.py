"""The one place that builds a control process: every collaborator is made here and handed to
the objects that use it through their constructors, so no object sets another's attributes.

Order (``assemble``): topology and page table; the engine model (each rank's fitted step time) and the
pricer that reads it, with the measured reuse of evictions; the transfer cost model
(calibrated, or an uncalibrated link model its completed plans correct); the per-rank outbox;
the coordinator; the router and its route pipeline (``make_router``: pending prefixes, lease
steering, route-time pulls, reservation, demand, placement's chains, as the pool runs them);
the transfer policies; the control plane, which the coordinator tells of every plan that
publishes or ends, and the pulls of every waiting route they release.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from lmpool.config.engine import EngineConfig
from lmpool.config.routing import RoutingConfig
from lmpool.config.transfer import UNCALIBRATED_LINK
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.plane import ControlPlane, Outbox
from lmpool.control.pricing.engine_model import EngineModel
from lmpool.control.pricing.eviction import EvictionMemory
from lmpool.control.pricing.price import Limits, Pricer
from lmpool.control.routing.demand import RecordDemand
from lmpool.control.routing.pending import CountPending, PendingPrefixes
from lmpool.control.routing.registry import POLICIES
from lmpool.control.routing.reserve import Reserve
from lmpool.control.routing.route import RouteStage
from lmpool.control.routing.router import Router
from lmpool.control.topology import Topology
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.cost_model import TransferCostModel
from lmpool.control.transfers.leases import PlacementLeases, SteerToLeases
from lmpool.control.transfers.placement import HotChains, ObserveChains
from lmpool.control.transfers.policies import TransferPolicies
from lmpool.control.transfers.pull import RoutePulls
from lmpool.control.transfers.pull_price import PullPricer
from lmpool.protocol.spec import ControlSpec


class Parts(NamedTuple):
    """What a control process routes and transfers with, wired together (``assemble``)."""

    router: Router
    model: EngineModel
    coordinator: TransferCoordinator
    policies: TransferPolicies


def build_control_plane(spec: ControlSpec) -> ControlPlane:
    outbox = Outbox()
    plane: ControlPlane | None = None

    # Bound late: the plane is made last, from the others.
    def plan_ended(plan: Plan) -> None:
        assert plane is not None
        plane.plan_ended(plan)

    def plan_published(plan: Plan) -> None:
        assert plane is not None
        plane.plan_published(plan)

    def pull_resolved(request_id: str, outcome: str) -> None:
        assert plane is not None
        plane.pull_resolved(request_id, outcome)

    gbm = page_table(spec)
    parts = assemble(spec, gbm, outbox.send, plan_ended, plan_published, pull_resolved)
    plane = ControlPlane(spec, gbm, parts.router, parts.model, parts.coordinator, parts.policies, outbox)
    return plane


def page_table(spec: ControlSpec) -> GlobalBlockManager:
    pool = spec.pool
    cfg = pool.transfer.transfer_policy
    return GlobalBlockManager(pool.world_size, pool.engine.block_size, heat_half_life_s=cfg.heat_half_life_s,
                              route_hit_weight=cfg.route_hit_weight,
                              reservation_ttl_s=pool.routing_config.reservation_ttl_s)


def assemble(spec: ControlSpec, gbm: GlobalBlockManager, send: Callable[[int, object], None],
             plan_ended: Callable[[Plan], None], plan_published: Callable[[Plan], None],
             pull_resolved: Callable[[str, str], None]) -> Parts:
    """Everything but the plane, over ``gbm``: the coordinator sends orders with ``send`` and
    reports plans that end or publish; pulls report the routes they release."""
    pool = spec.pool
    transfer, cfg = pool.transfer, pool.transfer.transfer_policy
    links = topology(spec)
    model = EngineModel(pool.world_size)
    evictions = EvictionMemory(pool.world_size)
    gbm.watch_removed(evictions.removed)
    pricer = Pricer(gbm, links, model, limits(pool.engine, spec.cascade_min_saved, pool.routing_config.cascade_groups),
                    evictions.reuse)
    gbm.watch_load(pricer.reported)  # a rank's work is priced as its report lands, not by the next route
    costs = cost_model(spec)
    # A restarted control process must not reuse the plan ids its predecessor's plans hold on
    # the workers, hence a random start.
    coordinator = TransferCoordinator(gbm, send, cost_model=costs, on_end=plan_ended,
                                      first_plan_id=random.getrandbits(48), on_published=plan_published)
    steering = chains = pulls = None
    if transfer.background_placement:
        steering = SteerToLeases(PlacementLeases(cfg.lease_s, clock=gbm.clock))
        chains = HotChains(cfg.recent_chains)
    if transfer.route_pulls:
        # CUDA workers serve plan orders while a step runs (``Worker.while_stepping``); a source
        # answers at once only under overlapped stepping (``worker.transfers``).
        cuda = pool.device == "cuda"
        pricing = PullPricer(gbm, links, pricer, costs.estimate, coordinator.room,
                             source_held=not (cuda and pool.engine.async_scheduling), dest_held=not cuda)
        pulls = RoutePulls(gbm, coordinator, pricing, pull_resolved, pool.routing_config.price_tie)
    router = make_router(gbm, links, pool.routing, pool.routing_config, pricer, evictions, steering, pulls, chains)
    policies = TransferPolicies(spec, gbm, links, pricer, coordinator, send, steering, pulls, chains)
    return Parts(router, model, coordinator, policies)


def make_router(gbm: GlobalBlockManager, links: Topology, routing: str = "lmpool", config: RoutingConfig | None = None,
                pricer: Pricer | None = None, evictions: EvictionMemory | None = None,
                steering: SteerToLeases | None = None, pulls: RoutePulls | None = None,
                chains: HotChains | None = None) -> Router:
    """The router for policy ``routing`` and its pipeline (``lmpool.control.routing.route``): the
    policy's pending prefixes when it counts them, then lease steering, pulls (both only act on
    a priced route), the reservation, the demand, and placement's routed chains, in that order.
    Without a ``pricer``, one over the prior step times and the engine's default limits; with
    one, its limits price cascades as ``config`` does (``cascade_groups``)."""
    if routing not in POLICIES:
        raise ValueError(f"unknown routing policy {routing!r}; choose one of {', '.join(POLICIES)}")
    config = config or RoutingConfig()
    if pricer is None:
        pricer = Pricer(gbm, links, EngineModel(gbm.world_size),
                        Limits(gbm.block_size, 256, 8192, cascade_groups=config.cascade_groups),
                        evictions.reuse if evictions is not None else lambda rank: 0.5)
    elif pricer.limits.cascade_groups != config.cascade_groups:
        raise ValueError(f"the pricer's cascade_groups ({pricer.limits.cascade_groups}) is not the routing "
                         f"config's ({config.cascade_groups})")
    policy = POLICIES[routing](gbm, config, pricer)
    stages: list[RouteStage] = [s for s in (steering, pulls) if s is not None]
    if policy.counts_pending and config.pending_ttl_s > 0:
        pending = PendingPrefixes(gbm.world_size, config.pending_ttl_s, gbm.clock)
        gbm.watch_stored(pending.confirm)
        stages.append(CountPending(pending))
    stages += [Reserve(gbm, pricer), RecordDemand(gbm, evictions)]
    if chains is not None:
        stages.append(ObserveChains(chains))
    return Router(gbm, links, policy, stages)


def limits(engine: EngineConfig, cascade_min_saved: int, cascade_groups: bool) -> Limits:
    """What the ranks' schedulers allow; ``cascade_min_saved`` as the engines resolve it
    (``config.engine.cascade_min_saved``, carried by the ``ControlSpec``); ``cascade_groups`` as
    the routing config sets it. A CPU rank steps overlapped in name only: its launch is the step,
    and its worker reads each step back before the next launch (``EngineCore.read_finished``)."""
    overlapped = engine.async_scheduling and engine.device.startswith("cuda")
    return Limits(engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens, overlapped,
                  cascade_min_saved, cascade_groups)


def topology(spec: ControlSpec) -> Topology:
    pool = spec.pool
    if pool.topology is None:
        return Topology.detect(pool.world_size, pool.device, pool.gpu_of_rank())
    return Topology.from_pairs(pool.world_size, [(a, b) for a, b in pool.topology], pool.gpu_of_rank())


def cost_model(spec: ControlSpec) -> TransferCostModel:
    """The transfer cost model: the calibration profile's, or a plain link model for the pool's
    device kind; completed plans correct either online."""
    kv_bytes = max(1, spec.kv_bytes_per_block)
    profile = spec.pool.transfer.transfer_policy.transfer_profile
    if profile is not None:
        return TransferCostModel.from_profile(profile, kv_bytes)
    fixed_s, bytes_per_s = UNCALIBRATED_LINK["cuda" if spec.pool.device == "cuda" else "cpu"]
    return TransferCostModel.uncalibrated(kv_bytes, fixed_s, bytes_per_s)
