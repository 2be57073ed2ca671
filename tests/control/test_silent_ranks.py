"""A rank that reports nothing, not even a heartbeat, for over ``hang_timeout`` leaves routing
until it reports again (``GlobalBlockManager.mark_silent``, ``ControlPlane.watch_silence``):
its cache and load as last reported are stale, and it may be hung or have lost its link."""

from __future__ import annotations

from control_testkit import ManualClock

from lmpool.config.pool import PoolConfig
from lmpool.control.build import build_control_plane, make_router
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.kv_events import KVSnapshot
from lmpool.protocol.spec import ControlSpec

TIMEOUT = 5.0


def pool(clock: ManualClock, world: int = 3) -> GlobalBlockManager:
    gbm = GlobalBlockManager(world, 4, clock=clock)
    for r in range(world):
        gbm.register_rank(r, 1, 64)
        gbm.apply_snapshot(r, 1, KVSnapshot(0, []))
        gbm.update_load(r, 1, LoadReport(blocks_free=64))
    return gbm


def test_a_silent_rank_is_routed_around_until_it_reports_again():
    clock = ManualClock()
    gbm = pool(clock)
    router = make_router(gbm, Topology.from_pairs(3, []), "round_robin")
    clock.now += TIMEOUT / 2
    gbm.heartbeat(0, 1)
    gbm.heartbeat(2, 1)
    clock.now += TIMEOUT * 0.75  # rank 1: 1.25 timeouts silent; the others 0.75
    assert gbm.mark_silent(TIMEOUT) == [1] and gbm.mark_silent(TIMEOUT) == []  # found once
    gbm.check_invariants()
    routed = {router.route(RouteQuery(f"q{i}", [], 5, 4)).rank for i in range(6)}
    assert routed == {0, 2}
    gbm.heartbeat(1, 1)  # it reports: routable again
    assert {router.route(RouteQuery(f"r{i}", [], 5, 4)).rank for i in range(6)} == {0, 1, 2}


def test_when_every_rank_is_silent_routing_falls_back_to_the_alive_ones():
    clock = ManualClock()
    gbm = pool(clock, world=2)
    router = make_router(gbm, Topology.from_pairs(2, []), "round_robin")
    gbm.mark_dead(1)
    clock.now += 2 * TIMEOUT
    assert gbm.mark_silent(TIMEOUT) == [0]  # the dead rank is not silent: it is dead
    assert router.route(RouteQuery("q", [], 5, 4)).rank == 0
    gbm.check_invariants()


def test_the_control_plane_watches_silence_only_with_a_hang_timeout():
    for timeout, silent in ((TIMEOUT, [0, 1]), (None, [])):
        spec = ControlSpec(pool=PoolConfig.from_options("unused", world_size=2, device="cpu", block_size=4,
                                                        hang_timeout=timeout),
                           frontend_end="unused", worker_ends=["unused", "unused"])
        plane = build_control_plane(spec)
        for r in range(2):
            plane.gbm.register_rank(r, 1, 16)
            plane.gbm.ranks[r].last_heartbeat -= 2 * TIMEOUT  # heard from two timeouts ago
        plane.watch_silence()
        assert [r for r in range(2) if not plane.gbm.routable_mask >> r & 1] == silent
