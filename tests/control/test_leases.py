"""Placement leases: lookup by chained hash, expiry and bounds, and how they steer a priced
route to a copy only when the copy is usable, feasible and cheaper than the policy's choice."""

from __future__ import annotations

import pytest

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.registry import POLICIES
from lmpool.control.transfers.leases import PlacementLeases, SteerToLeases
from lmpool.control.topology import Topology
from lmpool.protocol.kv_events import KVSnapshot
from lmpool.protocol import LoadReport, RouteQuery
from control_testkit import ManualClock, cache, priced_router

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
BUSY = LoadReport(blocks_free=100, num_running=3, context_tokens=6000, decode_tokens_left=48)


def make(policy: str = "lmpool", world: int = 2):
    clock = ManualClock()
    gbm = GlobalBlockManager(world, BLOCK, clock=clock)
    for rank in range(world):
        gbm.register_rank(rank, 1, 100)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        gbm.update_load(rank, 1, LoadReport(blocks_free=100))
    steering = SteerToLeases(PlacementLeases(lease_s=30.0, clock=clock))
    sched = priced_router(gbm, Topology.virtual(world), policy, steering=steering)
    # The owner (rank 0) holds the whole chain and is busy, within the bounded-load gate; rank 1
    # got a copy of its first 2 blocks.
    cache(gbm, 0, CHAIN)
    cache(gbm, 1, CHAIN[:2])
    gbm.update_load(0, 1, BUSY)
    return clock, gbm, sched, steering


_ids = iter(range(10**9))


def route(sched, hashes=CHAIN):
    q = RouteQuery(f"q{next(_ids)}", hashes, len(hashes) * BLOCK + 5, 8)
    decision = sched.route(q)
    sched.gbm.release(q.request_id)
    return decision


def test_without_a_lease_the_owner_keeps_the_request():
    _, _, sched, steering = make()
    decision = route(sched)
    assert decision.rank == 0 and decision.reason.startswith("owner r0")
    assert steering.routed == 0


def test_a_lease_steers_to_the_cheaper_copy_and_is_counted():
    _, _, sched, steering = make()
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    decision = route(sched)
    assert decision.rank == 1 and decision.matched_blocks == 2
    assert decision.reason.startswith("lease r1 m2") and "over owner r0" in decision.reason
    assert steering.routed == 1


def test_a_lease_never_steers_to_a_costlier_copy():
    _, gbm, sched, steering = make()
    gbm.update_load(1, 1, LoadReport(blocks_free=100, num_running=3, context_tokens=12_000, decode_tokens_left=48))
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched).rank == 0 and steering.routed == 0


def test_a_lease_never_steers_to_a_rank_without_room():
    _, gbm, sched, steering = make()
    gbm.update_load(1, 1, LoadReport(blocks_free=1))
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched).rank == 0 and steering.routed == 0


def test_a_lease_whose_copy_is_gone_is_dropped():
    _, gbm, sched, steering = make()
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    cache(gbm, 1, CHAIN[:1])  # rank 1 evicted the second block
    assert route(sched).rank == 0 and len(steering.leases) == 0


def test_an_expired_lease_or_another_prompt_is_not_steered():
    clock, _, sched, steering = make()
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    assert route(sched, [999, 998]).rank in (0, 1) and steering.routed == 0, "another chain"
    clock.now = 31.0
    assert route(sched).rank == 0 and steering.routed == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_leases_steer_only_a_priced_route(policy):
    """A lease's copy wins where the policy prices its candidates (LMPool's); the peers' rules
    stand as they are (no peer runs with placement)."""
    _, gbm, sched, steering = make(policy)
    gbm.update_load(0, 1, LoadReport(blocks_free=100, num_waiting=1, num_running=3, context_tokens=6000,
                                     decode_tokens_left=48, blocks_used=90))
    steering.leases.grant(CHAIN[1], depth=2, src=0, dst=1)
    decision = route(sched)
    assert steering.routed == (policy == "lmpool"), decision.reason
    assert decision.reason.startswith("lease r1") == (policy == "lmpool")
