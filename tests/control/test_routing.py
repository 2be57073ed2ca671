"""Router.route_sequence_meta: the LMPool cost model and bounded spill, capacity and
reservations, seeds and topology, dead ranks, and each baseline against its published rule."""

from __future__ import annotations

import collections
import math

import pytest

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.config import RoutingConfig
from lmpool.control.routing.registry import POLICIES
from lmpool.control.routing.router import NoAliveRankError, Router
from lmpool.control.topology import Topology
from lmpool.protocol.kv_events import KVSnapshot
from lmpool.protocol import LoadReport, RouteQuery
from control_testkit import ManualClock, cache

BLOCK = 16
NUM_BLOCKS = 1000


def make(world=4, policy="lmpool", topology=None, config=None, clock=None):
    gbm = GlobalBlockManager(world, BLOCK, reservation_ttl_s=5.0, clock=clock or ManualClock())
    for rank in range(world):
        gbm.register_rank(rank, 1, NUM_BLOCKS)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
    return gbm, Router(gbm, topology or Topology.virtual(world), policy, config)


def chain(n: int, family: int = 1) -> list[int]:
    return [family * 1000 + i + 1 for i in range(n)]


def load(gbm: GlobalBlockManager, rank: int, **fields) -> None:
    fields.setdefault("blocks_free", NUM_BLOCKS)
    gbm.update_load(rank, 1, LoadReport(**fields))


_ids = iter(range(10**9))


def query(hashes: list[int], extra_tokens: int = 5, max_tokens: int = 16) -> RouteQuery:
    return RouteQuery(f"q{next(_ids)}", hashes, len(hashes) * BLOCK + extra_tokens, max_tokens)


def release_all(gbm: GlobalBlockManager) -> None:
    for request_id in list(gbm.reservations):
        gbm.release(request_id)


def cost_of(scheduler: Router, rank: int) -> float:
    return next(c.cost for c in scheduler.policy.last_costs if c.rank == rank)


# ---- LMPool -------------------------------------------------------------------------------


def test_owner_chosen_on_a_prefix_hit():
    gbm, scheduler = make()
    cache(gbm, 2, chain(10))
    cache(gbm, 3, chain(4))
    decision = scheduler.route_sequence_meta(query(chain(10) + chain(2, family=9)))
    assert (decision.rank, decision.matched_blocks) == (2, 10)
    assert decision.reason.startswith("owner r2 m10 cost=")
    assert cost_of(scheduler, 2) == 2 * BLOCK + 5  # only the two new blocks and the tail to compute
    assert cost_of(scheduler, 3) == 8 * BLOCK + 5


def test_a_fully_cached_prompt_still_computes_its_last_block():
    gbm, scheduler = make()
    cache(gbm, 1, chain(10))
    decision = scheduler.route_sequence_meta(query(chain(10), extra_tokens=0))
    assert (decision.rank, decision.matched_blocks) == (1, 10)
    costs = {c.rank: c for c in scheduler.policy.last_costs}
    assert (costs[1].matched, costs[1].missing) == (9, BLOCK)


def test_without_any_hit_the_least_loaded_rank_wins():
    gbm, scheduler = make()
    for rank, waiting in enumerate([500, 0, 300, 200]):
        load(gbm, rank, waiting_prefill_tokens=waiting)
    decision = scheduler.route_sequence_meta(query(chain(6)))
    assert decision.rank == 1 and decision.reason.startswith("min_cost r1 m0")


def test_overloaded_owner_spills_to_a_cheaper_rank():
    gbm, scheduler = make()
    cache(gbm, 0, chain(10))
    load(gbm, 0, waiting_prefill_tokens=5000)
    decision = scheduler.route_sequence_meta(query(chain(10)))
    assert decision.rank == 1 and decision.matched_blocks == 0
    assert decision.reason == "spill r1 m0 cost=165 from owner r0 m10 cost=5005"


def test_spill_prefers_a_partial_holder():
    gbm, scheduler = make()
    cache(gbm, 0, chain(10))
    cache(gbm, 3, chain(6))
    load(gbm, 0, waiting_prefill_tokens=5000)
    decision = scheduler.route_sequence_meta(query(chain(10)))
    assert (decision.rank, decision.matched_blocks) == (3, 6)
    assert decision.reason.startswith("spill r3 m6")


def test_slightly_loaded_owner_keeps_the_request():
    gbm, scheduler = make()
    cache(gbm, 0, chain(10))
    load(gbm, 0, waiting_prefill_tokens=1000)  # below the 2048-token gap
    decision = scheduler.route_sequence_meta(query(chain(10)))
    # The cost model alone would move it (rank 1 is cheaper); the spill rule keeps it on its cache.
    assert cost_of(scheduler, 1) < cost_of(scheduler, 0)
    assert decision.rank == 0 and decision.reason.startswith("owner_kept r0 m10")


def test_spill_never_recomputes_more_than_the_bound():
    gbm, scheduler = make()
    cache(gbm, 0, chain(300))  # 4800 cached tokens: beyond the default 4096-token bound
    load(gbm, 0, waiting_prefill_tokens=20_000)
    assert scheduler.route_sequence_meta(query(chain(300))).rank == 0
    gbm, scheduler = make(config=RoutingConfig(spill_max_extra_tokens=8192))
    cache(gbm, 0, chain(300))
    load(gbm, 0, waiting_prefill_tokens=20_000)
    assert scheduler.route_sequence_meta(query(chain(300))).reason.startswith("spill r1")


def test_capacity_infeasible_ranks_are_skipped_unless_none_is_feasible():
    gbm, scheduler = make()
    cache(gbm, 0, chain(10))
    load(gbm, 0, blocks_free=1)  # the request needs ceil((165 + 16) / 16) - 10 = 2 new blocks
    decision = scheduler.route_sequence_meta(query(chain(10)))
    assert decision.rank == 1 and decision.reason.startswith("min_cost")
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, blocks_free=1)
    decision = scheduler.route_sequence_meta(query(chain(10)))
    assert decision.rank == 0 and decision.reason.startswith("no_capacity r0 m10")


def test_reclaim_pressure_and_decode_work_add_cost():
    gbm, scheduler = make()
    load(gbm, 0, blocks_free=0, blocks_reclaimable=500)
    load(gbm, 1, decode_tokens_left=1000)
    load(gbm, 2, blocks_free=500)
    load(gbm, 3, blocks_free=500, num_running=50)
    decision = scheduler.route_sequence_meta(query(chain(4)))
    need = math.ceil((4 * BLOCK + 5 + 16) / BLOCK)
    assert cost_of(scheduler, 0) - cost_of(scheduler, 2) == pytest.approx(0.25 * need * BLOCK)
    assert cost_of(scheduler, 1) - cost_of(scheduler, 2) == pytest.approx(0.1 * 1000)
    assert decision.rank == 2  # rank 3 ties on cost; the lower rank wins
    gbm, scheduler = make(config=RoutingConfig(decode_work="running", decode_weight=2.0))
    load(gbm, 0, num_running=50)
    assert scheduler.route_sequence_meta(query(chain(4))).rank == 1
    assert cost_of(scheduler, 0) - cost_of(scheduler, 1) == pytest.approx(100.0)


def test_concurrent_routes_never_overcommit_a_rank():
    """Many routes with no load report in between: reservations keep the stale capacity honest."""
    gbm, scheduler = make()
    for rank in range(4):
        load(gbm, rank, blocks_free=50, blocks_reclaimable=10)
    per_request = math.ceil((6 * BLOCK + 5 + 16) / BLOCK)  # 8 blocks: 7 fit in 60 per rank
    decisions = []
    for i in range(60):
        decisions.append(scheduler.route_sequence_meta(query(chain(6, family=i))))
        for info in gbm.ranks:
            assert info.reserved_blocks <= info.load.blocks_free + info.load.blocks_reclaimable
        gbm.check_invariants()
    fitting = 60 // per_request * 4
    assert all(not d.reason.startswith("no_capacity") for d in decisions[:fitting])
    assert collections.Counter(d.rank for d in decisions[:fitting]) == {r: fitting // 4 for r in range(4)}
    assert all(d.reason.startswith("no_capacity") for d in decisions[fitting:])
    assert len(gbm.reservations) == 60


def test_reservations_are_released_on_admission_and_by_ttl():
    clock = ManualClock()
    gbm, scheduler = make(world=2, clock=clock)
    for rank in range(2):
        load(gbm, rank, blocks_free=8)
    first = scheduler.route_sequence_meta(query(chain(6, family=1)))
    second = scheduler.route_sequence_meta(query(chain(6, family=2)))
    assert {first.rank, second.rank} == {0, 1}
    assert scheduler.route_sequence_meta(query(chain(6, family=3))).reason.startswith("no_capacity")
    # Rank 0 admits its request (its free blocks are now spent); the other reservation still holds.
    admitted = [rid for rid, r in gbm.reservations.items() if r.rank == 0]
    load(gbm, 0, blocks_free=8, admitted=admitted)
    assert gbm.ranks[0].reserved_blocks == 0 and all(r.rank != 0 for r in gbm.reservations.values())
    assert scheduler.route_sequence_meta(query(chain(6, family=4))).reason.startswith("min_cost r0")
    # Neither rank reports again: after the TTL their reservations lapse (else this would be no_capacity).
    clock.now += 6.0
    fifth = query(chain(6, family=5))
    assert scheduler.route_sequence_meta(fifth).reason.startswith("min_cost r0")
    assert list(gbm.reservations) == [fifth.request_id] and gbm.ranks[1].reserved_blocks == 0


def test_seed_restricts_candidates_to_its_nvlink_group():
    topology = Topology.from_pairs(4, [(0, 1), (2, 3)])
    gbm, scheduler = make(topology=topology)
    cache(gbm, 2, chain(10))
    for rank in (0, 1):
        load(gbm, rank, waiting_prefill_tokens=10_000)
    for _ in range(5):
        decision = scheduler.route_sequence_meta(query(chain(10)), seed_rank=0)
        assert decision.rank in (0, 1) and decision.matched_blocks == 0
    assert scheduler.route_sequence_meta(query(chain(10)), seed_rank=3).rank == 2
    assert scheduler.route_sequence_meta(query(chain(10))).rank == 2
    # With its whole group down, a seeded request goes to a live rank anyway.
    gbm.mark_dead(0)
    gbm.mark_dead(1)
    assert scheduler.route_sequence_meta(query(chain(3)), seed_rank=0).rank in (2, 3)


def test_topology_affinity_breaks_cost_ties_toward_the_seed():
    mesh = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    topology = Topology.from_pairs(4, mesh, gpu_of_rank=[0, 1, 1, 2])  # ranks 1 and 2 share GPU 1
    gbm, scheduler = make(topology=topology)
    load(gbm, 2, waiting_prefill_tokens=100)
    load(gbm, 3, waiting_prefill_tokens=100)
    # Ranks 0 and 1 tie on cost: from seed 2, rank 1 (same GPU) beats rank 0 (NVLink only).
    assert scheduler.route_sequence_meta(query(chain(3)), seed_rank=2).rank == 1
    release_all(gbm)
    assert scheduler.route_sequence_meta(query(chain(3, family=2))).rank == 0  # no seed: the lower rank


def test_a_burst_sharing_a_new_prefix_goes_to_one_owner_until_the_pending_prefix_expires():
    clock = ManualClock()
    gbm, scheduler = make(clock=clock, config=RoutingConfig(pending_ttl_s=5.0))
    prefix = chain(20)
    first = scheduler.route_sequence_meta(query(prefix + chain(1, family=7)))
    second = scheduler.route_sequence_meta(query(prefix + chain(1, family=8)))
    assert first.rank == second.rank, "the second request queues behind the first and reuses its prefill"
    assert second.matched_blocks == 0 and second.reason.startswith(f"owner_kept r{first.rank} m20")
    own = {c.rank: c for c in scheduler.policy.last_costs}[first.rank]
    assert own.missing == 1 * BLOCK + 5, "only its own block and tail are left to compute there"
    clock.now += 5.0
    release_all(gbm)
    load(gbm, first.rank, waiting_prefill_tokens=10_000)  # the producer is still prefilling
    third = scheduler.route_sequence_meta(query(prefix + chain(1, family=9)))
    assert third.rank != first.rank, "an expired pending prefix counts for nothing"


def test_a_reported_block_ends_its_pending_entry_so_a_later_eviction_counts():
    gbm, scheduler = make(config=RoutingConfig(pending_ttl_s=5.0))
    prefix = chain(20)
    a = scheduler.route_sequence_meta(query(prefix)).rank
    cache(gbm, a, prefix[:5])  # the producer's first blocks are reported ...
    assert scheduler.pending.extend(a, prefix, 5) == 20
    cache(gbm, a, [])  # ... and evicted again: only the 15 never reported still pend
    assert gbm.prefix_match(prefix)[a] == 0 and scheduler.pending.extend(a, prefix, 0) == 0


def test_pending_prefixes_are_off_at_zero_ttl_and_forgotten_when_a_rank_goes_down():
    gbm, scheduler = make(config=RoutingConfig(pending_ttl_s=0))
    a = scheduler.route_sequence_meta(query(chain(20)))
    assert scheduler.pending is None and scheduler.route_sequence_meta(query(chain(20))).rank != a.rank
    gbm, scheduler = make()  # on by default
    a = scheduler.route_sequence_meta(query(chain(20)))
    scheduler.rank_down(a.rank)
    assert not gbm.ranks[a.rank].alive and len(scheduler.pending) == 0
    with pytest.raises(ValueError, match="pending_ttl_s"):
        RoutingConfig(pending_ttl_s=-1)


def test_unpublished_blocks_never_count():
    gbm, scheduler = make()
    cache(gbm, 1, chain(2))
    for i, h in enumerate(chain(10)[2:]):
        assert gbm.mark_in_flight(1, h, block_id=100 + i, generation=1)
    decision = scheduler.route_sequence_meta(query(chain(10)))
    assert decision.matched_blocks == 2 and decision.rank == 1
    for h in chain(10)[2:]:
        gbm.unmark_in_flight(1, h, published=True)
    assert scheduler.route_sequence_meta(query(chain(10))).matched_blocks == 10
    gbm.check_invariants()


def test_routes_record_demand_for_cached_blocks():
    gbm, scheduler = make()
    cache(gbm, 0, chain(4))
    cache(gbm, 1, chain(2))
    load(gbm, 0, waiting_prefill_tokens=10_000)
    decision = scheduler.route_sequence_meta(query(chain(6)))
    assert decision.rank == 1
    stats = [gbm.hash_stats(h) for h in chain(6)]
    assert [(s.accesses, s.route_hits) for s in stats[:4]] == [(1, 1), (1, 1), (1, 0), (1, 0)]
    assert stats[4] is None and stats[5] is None


@pytest.mark.parametrize("policy", POLICIES)
def test_dead_ranks_are_never_chosen(policy):
    gbm, scheduler = make(policy=policy)
    cache(gbm, 1, chain(8))
    gbm.mark_dead(1)
    for i in range(12):
        decision = scheduler.route_sequence_meta(query(chain(8) if i % 2 else chain(5, family=i + 10)))
        assert decision.rank != 1
        gbm.check_invariants()
    for rank in (0, 2, 3):
        gbm.mark_dead(rank)
    with pytest.raises(NoAliveRankError):
        scheduler.route_sequence_meta(query(chain(3)))


def test_bad_policy_config_and_topology_are_rejected():
    gbm = GlobalBlockManager(4, BLOCK)
    with pytest.raises(ValueError, match="lmpool, round_robin, least_loaded, sglang_cache_aware, dynamo_kv"):
        Router(gbm, Topology.virtual(4), policy="random")
    with pytest.raises(ValueError, match="topology has 2 ranks"):
        Router(gbm, Topology.virtual(2))
    with pytest.raises(ValueError, match="decode_work"):
        RoutingConfig(decode_work="steps")
    with pytest.raises(ValueError, match="sglang_tree"):
        RoutingConfig(sglang_tree="radix")
    with pytest.raises(ValueError, match="reservation_ttl_s"):
        RoutingConfig(reservation_ttl_s=0)


# ---- baselines ----------------------------------------------------------------------------


def test_least_loaded_picks_min_of_four_waiting_plus_running():
    gbm, scheduler = make(policy="least_loaded")
    cache(gbm, 3, chain(8))  # cache plays no part
    for rank, (waiting, running) in enumerate([(1, 0), (0, 3), (0, 5), (2, 0)]):
        load(gbm, rank, num_waiting=waiting, num_running=running)
    # Scores 4, 3, 5, 8; each route counts as one more waiting request until admitted.
    ranks = [scheduler.route_sequence_meta(query(chain(8))).rank for _ in range(3)]
    assert ranks == [1, 0, 2]
    assert scheduler.route_sequence_meta(query(chain(8))).reason == "least_loaded r1 score=7"


def test_round_robin_cycles_over_alive_candidates():
    gbm, scheduler = make(policy="round_robin")
    assert [scheduler.route_sequence_meta(query(chain(2))).rank for _ in range(5)] == [0, 1, 2, 3, 0]
    gbm.mark_dead(2)
    assert [scheduler.route_sequence_meta(query(chain(2))).rank for _ in range(4)] == [1, 3, 0, 1]
    gbm, scheduler = make(policy="round_robin", topology=Topology.from_pairs(4, [(0, 1), (2, 3)]))
    assert [scheduler.route_sequence_meta(query(chain(2)), seed_rank=2).rank for _ in range(3)] == [2, 3, 2]


# The older rule sets, which the first tests of each peer pin (``eval_policies.PEER_VARIANTS``).
SGLANG_V0 = dict(sglang_cache_threshold=0.5, sglang_balance_abs_threshold=32, sglang_balance_rel_threshold=1.0001,
                 sglang_miss_rule="smallest_tree", sglang_balance_rule="max_min")
DYNAMO_V0 = dict(dynamo_prefill_tokens="full", dynamo_assume_kv_reuse=False)


def test_sglang_routes_by_its_approximate_tree_when_balanced():
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0))
    a = chain(8, family=1)
    first = scheduler.route_sequence_meta(query(a, extra_tokens=0))
    assert first.rank == 0 and first.reason.startswith("sglang_smallest_tree r0")
    # The router's own tree now holds `a` under rank 0 (no worker has reported anything).
    again = scheduler.route_sequence_meta(query(a, extra_tokens=0))
    assert again.rank == 0 and again.reason == "sglang_cache r0 rate=1.00"
    other = scheduler.route_sequence_meta(query(chain(8, family=2)))
    assert other.reason.startswith("sglang_smallest_tree r1")
    # Cache threshold 0.5 is strict: half the prompt matched is not enough.
    half = RouteQuery("half", a[:4] + chain(4, family=3), 8 * BLOCK, 16)
    assert scheduler.route_sequence_meta(half).reason.startswith("sglang_smallest_tree r2 size=0 rate=0.50")
    # Above it, the longest tree match wins: ranks 0 and 2 both hold a[:4] now; rank 2 has the lower load.
    more = RouteQuery("more", a[:4] + chain(3, family=4), 7 * BLOCK, 16)
    assert scheduler.route_sequence_meta(more).reason == "sglang_cache r2 rate=0.57"


def test_sglang_switches_to_the_shortest_queue_past_both_balance_thresholds():
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0))
    a = chain(8)
    scheduler.route_sequence_meta(query(a))  # rank 0's tree holds `a`
    release_all(gbm)
    load(gbm, 0, num_waiting=32)  # max - min = 32: not above balance_abs_threshold
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_cache r0")
    release_all(gbm)
    load(gbm, 0, num_waiting=33)
    assert scheduler.route_sequence_meta(query(a)).reason == "sglang_balance r1 load=0 max=33"
    release_all(gbm)
    # Relative threshold: 140 vs 100 is imbalanced at 1.0001, balanced at 1.5.
    for rank in range(4):
        load(gbm, rank, num_running=140 if rank == 0 else 100)
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_balance r1")
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(**{**SGLANG_V0, "sglang_balance_rel_threshold": 1.5}))
    scheduler.route_sequence_meta(query(a))
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, num_running=140 if rank == 0 else 100)
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_cache r0")


def test_sglang_can_read_the_page_table_instead():
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0, sglang_tree="page_table"))
    cache(gbm, 2, chain(8))
    cache(gbm, 0, chain(1, family=5))
    decision = scheduler.route_sequence_meta(query(chain(8)))
    assert decision.rank == 2 and decision.reason.startswith("sglang_cache r2")
    # A miss goes to the rank with the smallest share of the page table.
    assert scheduler.route_sequence_meta(query(chain(3, family=7))).rank == 1


def dynamo_cost(gbm, rank, q, overlap, weight):
    info = gbm.ranks[rank]
    prefill = (info.load.waiting_prefill_tokens + info.reserved_tokens + q.num_prompt_tokens - overlap * BLOCK)
    decode = info.load.blocks_used + info.reserved_blocks + math.ceil(q.num_prompt_tokens / BLOCK)
    return weight * prefill / BLOCK + decode


def dynamo_setup(config=None):
    gbm, scheduler = make(policy="dynamo_kv", config=config)
    cache(gbm, 0, chain(8))
    load(gbm, 0, blocks_used=50)
    load(gbm, 2, waiting_prefill_tokens=1000)
    load(gbm, 3, blocks_used=1)
    return gbm, scheduler, query(chain(10)), [8, 0, 0, 0]


@pytest.mark.parametrize("weight, expected", [(1.0, 1), (10.0, 0)])
def test_dynamo_picks_the_minimum_cost(weight, expected):
    gbm, scheduler, q, overlaps = dynamo_setup(RoutingConfig(**DYNAMO_V0, dynamo_overlap_score_weight=weight))
    costs = [dynamo_cost(gbm, r, q, overlaps[r], weight) for r in range(4)]
    assert min(range(4), key=costs.__getitem__) == expected
    decision = scheduler.route_sequence_meta(q)
    assert decision.rank == expected
    assert decision.reason == f"dynamo_min_cost r{expected} cost={costs[expected]:.1f}"


def test_dynamo_temperature_samples_by_normalized_softmax():
    gbm, scheduler, q, overlaps = dynamo_setup(RoutingConfig(**DYNAMO_V0, dynamo_temperature=1.0, seed=7))
    costs = [dynamo_cost(gbm, r, q, overlaps[r], 1.0) for r in range(4)]
    lo, hi = min(costs), max(costs)
    weights = [math.exp(-(c - lo) / (hi - lo)) for c in costs]
    expected = [w / sum(weights) for w in weights]
    n = 3000
    counts = collections.Counter()
    for i in range(n):
        counts[scheduler.route_sequence_meta(RouteQuery(f"t{i}", q.block_hashes, q.num_prompt_tokens, 16)).rank] += 1
        release_all(gbm)
    for rank in range(4):
        assert counts[rank] / n == pytest.approx(expected[rank], abs=0.03)


def test_the_configurable_routing_names_are_the_registered_policies():
    from lmpool.config.pool import ROUTINGS
    from lmpool.control.routing.registry import POLICIES as REGISTERED

    assert sorted(ROUTINGS) == sorted(REGISTERED)


def test_sglang_gateway_defaults_route_a_miss_to_the_least_loaded_worker():
    """smg 1.13's ``cache_aware`` as ``smg launch`` runs it: thresholds 0.3 / 64 / 1.5, a miss to
    the least-loaded worker (not the smallest tree)."""
    gbm, scheduler = make(policy="sglang_cache_aware")
    a = chain(10, family=1)
    scheduler.route_sequence_meta(query(a))  # rank 0's tree holds `a`; its reservation is load 1 there
    release_all(gbm)
    load(gbm, 0, num_running=3)
    load(gbm, 1, num_running=2)
    load(gbm, 2, num_running=1)
    load(gbm, 3, num_running=4)
    # 4 of 10 blocks matched (rate 0.4 > 0.3): a hit stays on the tree's owner despite its load.
    hit = RouteQuery("hit", a[:4] + chain(6, family=2), 10 * BLOCK, 16)
    assert scheduler.route_sequence_meta(hit).reason == "sglang_cache r0 rate=0.40"
    release_all(gbm)
    # 2 of 10 (0.2): a miss, to the least-loaded worker; every tree but rank 0's is empty.
    miss = RouteQuery("miss", a[:2] + chain(8, family=3), 10 * BLOCK, 16)
    assert scheduler.route_sequence_meta(miss).reason == "sglang_miss_least_loaded r2 load=1 rate=0.20"


def test_sglang_gateway_defaults_spill_a_hit_past_the_fleet_mean():
    """smg 1.13's spill gate: the matched worker is passed over once its load exceeds the fleet's
    mean by min(64, max(4, 2 * sqrt(mean))) and 1.5 times the mean."""
    gbm, scheduler = make(policy="sglang_cache_aware")
    a = chain(8)
    scheduler.route_sequence_meta(query(a))  # rank 0's tree holds `a`
    # Rank 0 alone loaded, the others idle: mean = L / 4 and the margin 4 while L < 64, so the
    # gate opens from L = 6 (6 > 1.5 + 4), not at the old rule's gap of 65.
    for running, verdict in ((5, "sglang_cache r0"), (6, "sglang_spill r1 load=0 over r0 load=6")):
        release_all(gbm)
        load(gbm, 0, num_running=running)
        assert scheduler.route_sequence_meta(query(a)).reason.startswith(verdict)
    gbm, scheduler = make(policy="sglang_cache_aware")
    scheduler.route_sequence_meta(query(a))
    # A busy fleet: mean 100.25, margin 2 * sqrt(mean) = 20.02; rank 0 at 121 passes the margin
    # but not 1.5 times the mean (150.4): it keeps its hit.
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, num_running=121 if rank == 0 else 93)
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_cache r0")
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(sglang_balance_rel_threshold=1.0))
    scheduler.route_sequence_meta(query(a))
    release_all(gbm)
    for rank in range(4):  # mean 100.25 + 20.02 = 120.27: 121 spills, at ratio 1.0
        load(gbm, rank, num_running=121 if rank == 0 else 93)
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_spill r1")


def test_sglang_older_balance_rule_switches_the_whole_pool_past_64_and_one_and_a_half_times():
    gbm, scheduler = make(policy="sglang_cache_aware", config=RoutingConfig(sglang_balance_rule="max_min"))
    a = chain(8)
    scheduler.route_sequence_meta(query(a))
    for running, verdict in ((64, "sglang_cache r0"), (65, "sglang_balance r1")):
        release_all(gbm)
        load(gbm, 0, num_running=running)  # the others idle: a gap of 64 is not above the threshold
        assert scheduler.route_sequence_meta(query(a)).reason.startswith(verdict)
    release_all(gbm)
    for rank in range(4):  # a gap of 70, but 240 / 170 < 1.5: balanced
        load(gbm, rank, num_running=240 if rank == 0 else 170)
    assert scheduler.route_sequence_meta(query(a)).reason.startswith("sglang_cache r1")  # it holds `a` too now


def test_dynamo_charges_queued_requests_only_their_new_tokens_and_counts_shared_blocks_once():
    """Dynamo's defaults: a rank's queued prefill is its requests' prompts less their cached
    overlap (``LoadReport.new_prefill_tokens``), and a request adds to the decode term only the
    blocks it does not share with what the rank holds."""
    gbm, scheduler = make(world=2, policy="dynamo_kv")
    cache(gbm, 0, chain(8))
    # Rank 0 queues requests that will hit its cache: 4,000 prompt tokens, 200 of them new.
    load(gbm, 0, blocks_used=10, waiting_prefill_tokens=4000, new_prefill_tokens=200)
    load(gbm, 1, blocks_used=10)
    q = query(chain(10))  # 10 blocks + 5 tokens: 11 blocks, 8 of them cached on rank 0
    prefill = {0: (200 + q.num_prompt_tokens - 8 * BLOCK) / BLOCK, 1: q.num_prompt_tokens / BLOCK}
    decode = {0: 10 + (11 - 8), 1: 10 + 11}
    cost = {r: prefill[r] + decode[r] for r in (0, 1)}
    decision = scheduler.route_sequence_meta(q)
    assert decision.rank == 0 and decision.reason == f"dynamo_min_cost r0 cost={cost[0]:.1f}"
    # The older copy charged rank 0 all 4,000 queued tokens and all 11 blocks: it goes to rank 1.
    gbm, scheduler = make(world=2, policy="dynamo_kv", config=RoutingConfig(**DYNAMO_V0))
    cache(gbm, 0, chain(8))
    load(gbm, 0, blocks_used=10, waiting_prefill_tokens=4000, new_prefill_tokens=200)
    load(gbm, 1, blocks_used=10)
    assert scheduler.route_sequence_meta(query(chain(10))).rank == 1


def test_unknown_peer_rule_names_are_refused():
    with pytest.raises(ValueError, match="sglang_miss_rule"):
        RoutingConfig(sglang_miss_rule="random")
    with pytest.raises(ValueError, match="dynamo_prefill_tokens"):
        RoutingConfig(dynamo_prefill_tokens="some")
    with pytest.raises(ValueError, match="sglang_balance_rule"):
        RoutingConfig(sglang_balance_rule="mean")
