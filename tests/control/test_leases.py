"""Placement leases: lookup by chained hash, expiry and bounds, and how they steer routing to a
copy only when the copy is usable, feasible and cheaper than the policy's choice."""

from __future__ import annotations

import pytest

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.registry import POLICIES
from lmpool.control.routing.router import Router
from lmpool.control.transfers.leases import PlacementLeases
from lmpool.control.topology import Topology
from lmpool.protocol.kv_events import KVSnapshot
from lmpool.protocol import LoadReport, RouteQuery
from control_testkit import ManualClock, cache

BLOCK = 16


def test_find_returns_the_deepest_live_lease_of_a_prefix():
    clock = ManualClock()
    leases = PlacementLeases(lease_s=10.0, clock=clock, max_leases=2)
    leases.grant(2, depth=2, src=0, dst=1)
    leases.grant(3, depth=3, src=0, dst=2)
    assert leases.find([1, 2, 3, 4]).dst == 2
    assert leases.find([1, 2, 9]).dst == 1
    assert leases.find([2, 3]) is None, "a hash at another depth names another chain"
    assert leases.find([]) is None
    leases.grant(5, depth=1, src=0, dst=1)
    assert len(leases) == 2 and leases.find([1, 2]) is None, "bounded: the oldest lease went"
    clock.now = 10.0
    assert leases.find([1, 2, 3]) is None and len(leases) == 1, "expired: dropped when met"
    assert leases.expire() == 1 and len(leases) == 0
    with pytest.raises(ValueError):
        leases.grant(1, depth=0, src=0, dst=1)


CHAIN = [101, 102, 103]


def make(policy: str = "lmpool", world: int = 2):
    clock = ManualClock()
    gbm = GlobalBlockManager(world, BLOCK, clock=clock)
    for rank in range(world):
        gbm.register_rank(rank, 1, 100)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        gbm.update_load(rank, 1, LoadReport(blocks_free=100))
    sched = Router(gbm, Topology.virtual(world), policy, leases=PlacementLeases(lease_s=30.0, clock=clock))
    # The owner (rank 0) holds the whole chain and is busy; rank 1 got a copy of its first 2 blocks.
    cache(gbm, 0, CHAIN)
    cache(gbm, 1, CHAIN[:2])
    gbm.update_load(0, 1, LoadReport(blocks_free=100, waiting_prefill_tokens=500))
    return clock, gbm, sched


_ids = iter(range(10**9))


def route(sched, hashes=CHAIN):
    q = RouteQuery(f"q{next(_ids)}", hashes, len(hashes) * BLOCK + 5, 8)
    decision = sched.route_sequence_meta(q)
    sched.gbm.release(q.request_id)
    return decision


def test_without_a_lease_the_owner_keeps_the_request():
    _, _, sched = make()
    decision = route(sched)
    assert decision.rank == 0 and decision.reason.startswith("owner_kept")
    assert sched.lease_routed == 0


def test_a_lease_steers_to_the_cheaper_copy_and_is_counted():
    _, _, sched = make()
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    decision = route(sched)
    assert decision.rank == 1 and decision.matched_blocks == 2
    assert decision.reason.startswith("lease r1 m2") and "over owner_kept r0" in decision.reason
    assert sched.lease_routed == 1


def test_a_lease_never_steers_to_a_costlier_copy():
    _, gbm, sched = make()
    gbm.update_load(1, 1, LoadReport(blocks_free=100, waiting_prefill_tokens=2000))
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched).rank == 0 and sched.lease_routed == 0


def test_a_lease_never_steers_to_a_rank_without_room():
    _, gbm, sched = make()
    gbm.update_load(1, 1, LoadReport(blocks_free=1))
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched).rank == 0 and sched.lease_routed == 0


def test_a_lease_whose_copy_is_gone_is_dropped():
    _, gbm, sched = make()
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    cache(gbm, 1, CHAIN[:1])  # rank 1 evicted the second block
    assert route(sched).rank == 0 and len(sched.leases) == 0


def test_an_expired_lease_or_another_prompt_is_not_steered():
    clock, _, sched = make()
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched, [999, 998]).rank in (0, 1) and sched.lease_routed == 0, "another chain"
    clock.now = 31.0
    assert route(sched).rank == 0 and sched.lease_routed == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_leases_apply_after_every_policy(policy):
    _, gbm, sched = make(policy)
    gbm.update_load(0, 1, LoadReport(blocks_free=100, waiting_prefill_tokens=500, num_waiting=50, num_running=40,
                                     blocks_used=90))
    sched.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    decision = route(sched)
    assert decision.rank == 1, decision.reason


def test_rank_load_is_the_projection_load_term():
    _, gbm, sched = make()
    gbm.update_load(1, 1, LoadReport(blocks_free=100, waiting_prefill_tokens=70, decode_tokens_left=300))
    gbm.reserve("x", 1, blocks=1, tokens=11)
    q = RouteQuery("p", CHAIN, 3 * BLOCK + 5, 8)
    (cost,) = sched.costs.project(q, [1], [0, 2], None)
    assert sched.rank_load(1) == pytest.approx(cost.load) == pytest.approx(70 + 11 + 0.1 * 300)
