"""Router.route: LMPool's rule priced in predicted seconds with its bounded-load gate,
capacity and reservations, seeds and topology, dead ranks, and each baseline against its
published rule."""

from __future__ import annotations

import collections
import math

import msgspec

import pytest

from lmpool.config import RoutingConfig
from lmpool.config.engine import CASCADE_MIN_SAVED_TOKENS
from lmpool.control.build import make_router
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Limits
from lmpool.control.pricing.step_model import DEFAULT_PRIOR, StepCoefficients
from lmpool.control.routing.registry import POLICIES
from lmpool.control.routing.router import NoAliveRankError, Router
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.kv_events import KVSnapshot
from control_testkit import COEF, ManualClock, cache, chain_blocks, pending_of, priced_router

BLOCK = 16
NUM_BLOCKS = 1000


def make(world=4, policy="lmpool", topology=None, config=None, clock=None, reuse=0.5):
    gbm = GlobalBlockManager(world, BLOCK, reservation_ttl_s=5.0, clock=clock or ManualClock())
    for rank in range(world):
        gbm.register_rank(rank, 1, NUM_BLOCKS)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        load(gbm, rank)
    return gbm, priced_router(gbm, topology or Topology.virtual(world), policy, config, reuse=reuse)


def chain(n: int, family: int = 1) -> list[int]:
    return [family * 1000 + i + 1 for i in range(n)]


def load(gbm: GlobalBlockManager, rank: int, **fields) -> None:
    fields.setdefault("blocks_free", NUM_BLOCKS)
    # Queued prompts found nothing cached unless a test says otherwise: all of it is new (what
    # LMPool's price queues).
    fields.setdefault("new_prefill_tokens", fields.get("waiting_prefill_tokens", 0))
    gbm.update_load(rank, 1, LoadReport(**fields))


_ids = iter(range(10**9))


def query(hashes: list[int], extra_tokens: int = 5, max_tokens: int = 16) -> RouteQuery:
    return RouteQuery(f"q{next(_ids)}", hashes, len(hashes) * BLOCK + extra_tokens, max_tokens)


def release_all(gbm: GlobalBlockManager) -> None:
    for request_id in list(gbm.reservations):
        gbm.release(request_id)


def prices(router: Router, q: RouteQuery) -> dict:
    """Every alive rank's price for ``q`` now, from its ready match (what a route would see)."""
    gbm = router.gbm
    ranks = [r for r in range(gbm.world_size) if gbm.ranks[r].alive]
    return {p.rank: p for p in router.policy.pricer.serve(q, ranks, gbm.prefix_match(q.block_hashes), None)}


def idle_total_s(missing: int, prompt: int, max_tokens: int = 16) -> float:
    """The price on an idle rank (``COEF``): its prefill in one step, then its decode steps alone."""
    ttft = COEF.base + COEF.prefill_token * missing
    return ttft + (max_tokens - 1) * (COEF.base + COEF.decode_seq + COEF.context_token * (prompt + max_tokens / 2))


# ---- LMPool -------------------------------------------------------------------------------


def test_owner_chosen_on_a_prefix_hit():
    gbm, router = make()
    cache(gbm, 2, chain(10))
    cache(gbm, 3, chain(4))
    q = query(chain(10) + chain(2, family=9))
    decision = router.route(q)
    assert (decision.rank, decision.matched_blocks) == (2, 10)
    assert decision.reason.startswith("owner r2 m10 ttft=1.4ms price=")
    # Only the two new blocks and the tail to compute, on an idle rank: one step.
    assert decision.predicted_ttft_s == pytest.approx(COEF.base + COEF.prefill_token * (2 * BLOCK + 5))
    assert "; serve r0=" in decision.reason and " r3=" in decision.reason


def test_a_fully_cached_prompt_still_computes_its_last_block():
    gbm, router = make()
    cache(gbm, 1, chain(10))
    q = query(chain(10), extra_tokens=0)
    own = prices(router, q)[1]
    assert (own.matched, own.missing) == (9, BLOCK)
    decision = router.route(q)
    assert (decision.rank, decision.matched_blocks) == (1, 10)


def test_a_rank_is_priced_by_its_queue_its_decodes_and_the_delay_it_causes():
    """The pricing formula (``lmpool.control.pricing.price``) on a busy rank, worked by hand."""
    gbm, router = make()
    load(gbm, 0, num_running=4, context_tokens=4000, decode_tokens_left=40, waiting_prefill_tokens=100)
    q = query(chain(10))  # 165 prompt tokens, 16 to generate, nothing cached
    step = COEF.base + 4 * COEF.decode_seq + 4000 * COEF.context_token  # a step beside the 4 decodes
    prefill = 165 * COEF.prefill_token
    # The queued 100 tokens and its 165 fit one step together; then the step under way there, and
    # the next, launched with it.
    ttft = 100 * COEF.prefill_token + step + prefill + 2 * step
    mine = COEF.decode_seq + COEF.context_token * (165 + 8)  # what it adds to each shared step
    theirs = COEF.decode_seq + COEF.context_token * 1000  # what one of the four adds
    overlap = min(4 * 15, 40)
    decode = 15 * (COEF.base + mine) + overlap * theirs
    harm = overlap * mine + 4 * prefill
    busy, idle = prices(router, q)[0], prices(router, q)[1]
    assert busy.ttft_s == pytest.approx(ttft) and busy.total_s == pytest.approx(ttft + decode + harm)
    assert idle.total_s == pytest.approx(idle_total_s(165, 165))
    assert router.route(q).rank == 1


def test_without_any_hit_the_cheapest_rank_wins():
    gbm, router = make()
    for rank, waiting in enumerate([500, 0, 300, 200]):
        load(gbm, rank, waiting_prefill_tokens=waiting)
    decision = router.route(query(chain(6)))
    assert decision.rank == 1 and decision.reason.startswith("min_price r1 m0")


def test_long_contexts_decoding_cost_more_than_short_ones():
    gbm, router = make()
    load(gbm, 0, num_running=4, context_tokens=32_000, decode_tokens_left=64)
    load(gbm, 1, num_running=4, context_tokens=4000, decode_tokens_left=64)
    load(gbm, 2, num_running=6, context_tokens=30_000, decode_tokens_left=96)
    load(gbm, 3, num_running=6, context_tokens=30_000, decode_tokens_left=96)
    assert router.route(query(chain(6))).rank == 1


def test_an_overloaded_owner_spills_to_the_cheapest_rank():
    """The bounded-load gate (smg 1.13's): with the others idle, the owner's 5 requests in flight
    are within the margin (mean 1.25 + 4) and 6 are past it (mean 1.5 + 4)."""
    for running, verdict in ((5, "owner r0 m10"), (6, "spill r1 m0")):
        gbm, router = make()
        cache(gbm, 0, chain(10))
        load(gbm, 0, num_running=running, context_tokens=running * 200, decode_tokens_left=running * 16)
        q = query(chain(10))
        assert prices(router, q)[1].total_s < prices(router, q)[0].total_s  # cheaper elsewhere either way
        decision = router.route(q)
        assert decision.reason.startswith(verdict)
    assert " from owner r0 m10 " in decision.reason


def test_a_spill_prefers_a_partial_holder():
    gbm, router = make()
    cache(gbm, 0, chain(10))
    cache(gbm, 3, chain(6))
    load(gbm, 0, num_running=10, context_tokens=2000, decode_tokens_left=160)
    decision = router.route(query(chain(10)))
    assert (decision.rank, decision.matched_blocks) == (3, 6)
    assert decision.reason.startswith("spill r3 m6")


def test_a_small_match_owns_nothing():
    """A rank holding at most ``owner_min_match`` of the prompt is no owner: the price decides."""
    gbm, router = make()
    cache(gbm, 0, chain(2))  # 32 of 165 tokens: a miss
    load(gbm, 0, num_running=3, context_tokens=600, decode_tokens_left=48)
    decision = router.route(query(chain(10)))
    assert decision.rank == 1 and decision.reason.startswith("min_price r1")
    gbm, router = make()
    cache(gbm, 0, chain(5))  # 80 of 165: it owns the request, busy as it is
    load(gbm, 0, num_running=3, context_tokens=600, decode_tokens_left=48)
    assert router.route(query(chain(10))).reason.startswith("owner r0 m5")


def test_capacity_infeasible_ranks_are_skipped_unless_none_is_feasible():
    gbm, router = make()
    cache(gbm, 0, chain(10))
    load(gbm, 0, blocks_free=1)  # the request needs ceil((165 + 16) / 16) - 10 = 2 new blocks
    decision = router.route(query(chain(10)))
    assert decision.rank == 1 and decision.reason.startswith("min_price")
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, blocks_free=1)
    decision = router.route(query(chain(10)))
    assert decision.rank == 0 and decision.reason.startswith("owner r0 m10")


@pytest.mark.parametrize("left", [4, 400])
def test_an_owner_short_of_blocks_keeps_its_request_and_prices_the_wait(left):
    """Its cache is full of two running sequences: the request waits there for the first to
    finish (2 k / h of their mean decode left, k = 1 of h = 2), then prefills its 5 tokens."""
    gbm, router = make()
    cache(gbm, 0, chain(60))  # the request needs ceil((965 + 16) / 16) - 60 = 2 new blocks
    busy = dict(blocks_used=60, num_running=2, context_tokens=200, decode_tokens_left=left)
    load(gbm, 0, blocks_free=10, **busy)
    roomy = prices(router, query(chain(60)))[0]
    load(gbm, 0, blocks_free=1, **busy)
    short = prices(router, query(chain(60)))[0]
    assert short.short and short.feasible and not roomy.short
    step = COEF.base + 2 * COEF.decode_seq + 200 * COEF.context_token
    assert short.ttft_s - roomy.ttft_s == pytest.approx(left / 2 * step)
    assert router.route(query(chain(60))).reason.startswith("owner r0 m60")


def test_a_rank_that_cannot_hold_the_request_even_once_its_sequences_finish_is_skipped():
    gbm, router = make()
    cache(gbm, 0, chain(60))
    load(gbm, 0, blocks_free=0, blocks_used=1, num_running=1, decode_tokens_left=1)  # 1 block back of 2 needed
    assert not prices(router, query(chain(60)))[0].feasible
    assert router.route(query(chain(60))).rank != 0


def test_evicting_is_priced_by_the_measured_reuse_of_what_it_drops():
    need = math.ceil((4 * BLOCK + 5 + 16) / BLOCK)  # all of them evicted on rank 0
    for reuse in (0.1, 0.9):
        gbm, router = make(reuse=reuse)
        load(gbm, 0, blocks_free=0, blocks_reclaimable=500)
        q = query(chain(4))
        extra = prices(router, q)[0].total_s - prices(router, q)[1].total_s
        assert extra == pytest.approx(need * reuse * BLOCK * COEF.prefill_token)
        assert router.route(q).rank == 1


def test_concurrent_routes_never_overcommit_a_rank():
    """Many routes with no load report in between: reservations keep the stale capacity honest."""
    gbm, router = make()
    for rank in range(4):
        load(gbm, rank, blocks_free=50, blocks_reclaimable=10)
    per_request = math.ceil((6 * BLOCK + 5 + 16) / BLOCK)  # 8 blocks: 7 fit in 60 per rank
    decisions = []
    for i in range(60):
        decisions.append(router.route(query(chain(6, family=i))))
        for info in gbm.ranks:
            assert info.reserved_blocks <= info.load.blocks_free + info.load.blocks_reclaimable
        gbm.check_invariants()
    fitting = 60 // per_request * 4
    assert collections.Counter(d.rank for d in decisions[:fitting]) == {r: fitting // 4 for r in range(4)}
    # Past what fits now, each rank is a queue: the next request waits there for a reserved one
    # to finish, priced, and the routes stay even.
    assert all(not d.reason.startswith("no_capacity") for d in decisions)
    assert max(collections.Counter(d.rank for d in decisions).values()) - \
        min(collections.Counter(d.rank for d in decisions).values()) <= 1
    assert len(gbm.reservations) == 60


def test_reservations_carry_what_the_request_adds_to_its_rank():
    gbm, router = make()
    cache(gbm, 2, chain(4))
    q = query(chain(10), max_tokens=32)
    decision = router.route(q)
    r = gbm.reservations[q.request_id]
    assert r.rank == decision.rank == 2
    assert (r.tokens, r.attention, r.context, r.decode) == (101, 101 * 64 + 101 * 102 // 2, 165, 32)
    # The next request there is priced with it: its decode and context, as if reported.
    assert prices(router, query(chain(3, family=5)))[2].total_s > prices(router, query(chain(3, family=5)))[1].total_s


def test_reservations_are_released_on_admission_and_by_ttl():
    clock = ManualClock()
    gbm, router = make(world=2, clock=clock)
    for rank in range(2):
        load(gbm, rank, blocks_free=8)
    first = router.route(query(chain(6, family=1)))
    second = router.route(query(chain(6, family=2)))
    assert {first.rank, second.rank} == {0, 1}
    # Both ranks' blocks are reserved: the third waits for one of those requests to finish.
    third = router.route(query(chain(6, family=3)))
    assert third.predicted_ttft_s > first.predicted_ttft_s + 10 * COEF.base
    # Rank 0 admits its request (its free blocks are now spent); the other reservation still holds.
    admitted = [rid for rid, r in gbm.reservations.items() if r.rank == 0]
    load(gbm, 0, blocks_free=8, admitted=admitted)
    assert gbm.ranks[0].reserved_blocks == 0 and all(r.rank != 0 for r in gbm.reservations.values())
    assert router.route(query(chain(6, family=4))).reason.startswith("min_price r0")
    # Neither rank reports again: after the TTL their reservations lapse.
    clock.now += 6.0
    fifth = query(chain(6, family=5))
    assert router.route(fifth).reason.startswith("min_price r0")
    assert list(gbm.reservations) == [fifth.request_id] and gbm.ranks[1].reserved_blocks == 0


def test_seed_restricts_candidates_to_its_nvlink_group():
    topology = Topology.from_pairs(4, [(0, 1), (2, 3)])
    gbm, router = make(topology=topology)
    cache(gbm, 2, chain(10))
    for rank in (0, 1):
        load(gbm, rank, waiting_prefill_tokens=10_000)
    for _ in range(5):
        decision = router.route(query(chain(10)), seed_rank=0)
        assert decision.rank in (0, 1) and decision.matched_blocks == 0
    assert router.route(query(chain(10)), seed_rank=3).rank == 2
    assert router.route(query(chain(10))).rank == 2
    # With its whole group down, a seeded request goes to a live rank anyway.
    gbm.mark_dead(0)
    gbm.mark_dead(1)
    assert router.route(query(chain(3)), seed_rank=0).rank in (2, 3)


def test_topology_affinity_breaks_price_ties_toward_the_seed():
    mesh = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    topology = Topology.from_pairs(4, mesh, gpu_of_rank=[0, 1, 1, 2])  # ranks 1 and 2 share GPU 1
    gbm, router = make(topology=topology)
    load(gbm, 2, waiting_prefill_tokens=100)
    load(gbm, 3, waiting_prefill_tokens=100)
    # Ranks 0 and 1 tie on price: from seed 2, rank 1 (same GPU) beats rank 0 (NVLink only).
    assert router.route(query(chain(3)), seed_rank=2).rank == 1
    release_all(gbm)
    assert router.route(query(chain(3, family=2))).rank == 0  # no seed: the lower rank


def test_a_burst_sharing_a_new_prefix_goes_to_one_owner_until_the_pending_prefix_expires():
    clock = ManualClock()
    gbm, router = make(clock=clock, config=RoutingConfig(pending_ttl_s=5.0))
    prefix = chain(20)
    first = router.route(query(prefix + chain(1, family=7)))
    second = router.route(query(prefix + chain(1, family=8)))
    assert first.rank == second.rank, "the second request queues behind the first and reuses its prefill"
    assert second.matched_blocks == 0 and second.reason.startswith(f"owner r{first.rank} m20")
    # The first's prefill and its own block and tail fit one step together (a step beside the
    # first, reserved) ...
    first_prefill = 21 * BLOCK + 5
    step = COEF.base + COEF.decode_seq + COEF.context_token * first_prefill
    # ... then, the rank busy with the first, the step under way and the next (overlapped stepping).
    assert second.predicted_ttft_s == pytest.approx(3 * step + COEF.prefill_token * (first_prefill + BLOCK + 5))
    clock.now += 5.0
    release_all(gbm)
    load(gbm, first.rank, waiting_prefill_tokens=10_000)  # the producer is still prefilling
    third = router.route(query(prefix + chain(1, family=9)))
    assert third.rank != first.rank, "an expired pending prefix counts for nothing"


def test_a_reported_block_ends_its_pending_entry_so_a_later_eviction_counts():
    gbm, router = make(config=RoutingConfig(pending_ttl_s=5.0))
    prefix = chain(20)
    a = router.route(query(prefix)).rank
    cache(gbm, a, prefix[:5])  # the producer's first blocks are reported ...
    assert pending_of(router).extend(a, prefix, 5) == 20
    cache(gbm, a, [])  # ... and evicted again: only the 15 never reported still pend
    assert gbm.prefix_match(prefix)[a] == 0 and pending_of(router).extend(a, prefix, 0) == 0


def test_pending_prefixes_are_off_at_zero_ttl_and_forgotten_when_a_rank_goes_down():
    gbm, router = make(config=RoutingConfig(pending_ttl_s=0))
    a = router.route(query(chain(20)))
    assert pending_of(router) is None and router.route(query(chain(20))).rank != a.rank
    gbm, router = make()  # on by default
    a = router.route(query(chain(20)))
    router.rank_down(a.rank)
    assert not gbm.ranks[a.rank].alive and len(pending_of(router)) == 0
    with pytest.raises(ValueError, match="pending_ttl_s"):
        RoutingConfig(pending_ttl_s=-1)


def test_unpublished_blocks_never_count():
    gbm, router = make()
    cache(gbm, 1, chain(2))
    for i, h in enumerate(chain(10)[2:]):
        assert gbm.mark_in_flight(1, h, block_id=100 + i, generation=1)
    decision = router.route(query(chain(10)))
    assert decision.matched_blocks == 2
    for h in chain(10)[2:]:
        gbm.unmark_in_flight(1, h, published=True)
    assert router.route(query(chain(10))).matched_blocks == 10
    gbm.check_invariants()


def test_routes_record_demand_for_cached_blocks():
    gbm, router = make()
    cache(gbm, 0, chain(4))
    cache(gbm, 1, chain(2))
    load(gbm, 0, num_waiting=10, waiting_prefill_tokens=10_000)  # overloaded: it spills
    decision = router.route(query(chain(6)))
    assert decision.rank == 1
    stats = [gbm.hash_stats(h) for h in chain(6)]
    assert [(s.accesses, s.route_hits) for s in stats[:4]] == [(1, 1), (1, 1), (1, 0), (1, 0)]
    assert stats[4] is None and stats[5] is None


def test_a_chain_is_branched_once_prompts_continue_it_two_ways():
    """What a pull moves and what it copies (``HashStats.branched``)."""
    gbm, router = make()
    history = chain(4)
    cache(gbm, 0, history)
    router.route(query(history))  # a conversation's turn ends in its last block's tail
    router.route(query(history + chain(2, family=5)))  # its next turn extends it
    assert not any(gbm.hash_stats(h).branched for h in history)
    router.route(query(history[:2] + chain(3, family=6)))  # another prompt leaves it after block 2
    assert [gbm.hash_stats(h).branched for h in history] == [False, True, False, False]
    router.route(query(history))
    router.route(query(history))  # two prompts ending in the same tail: two questions
    assert gbm.hash_stats(history[-1]).branched


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pinned_request_goes_to_its_rank_and_counts_there(policy):
    """Pinned (``generate(rank=...)``), a request still reserves and records its prefix on its
    rank: a document read there is expected there before the rank reports a block of it."""
    gbm, router = make(policy=policy)
    doc = chain(20)
    pinned = msgspec.structs.replace(query(doc + chain(1, family=7)), pinned=3)
    decision = router.route(pinned)
    assert (decision.rank, decision.reason, decision.matched_blocks) == (3, "pinned", 0)
    assert decision.predicted_ttft_s is not None and decision.predicted_ttft_s > 0
    assert gbm.reservations[pinned.request_id].rank == 3
    gbm.check_invariants()
    if policy == "lmpool":  # it counts pending prefixes: the question follows its document
        follower = router.route(query(doc + chain(1, family=8)))
        assert follower.rank == 3 and follower.reason.startswith("owner r3 m20")
    gbm.mark_dead(3)
    assert router.route(pinned).rank != 3, "a dead pinned rank: routed as usual"


@pytest.mark.parametrize("policy", POLICIES)
def test_dead_ranks_are_never_chosen(policy):
    gbm, router = make(policy=policy)
    cache(gbm, 1, chain(8))
    gbm.mark_dead(1)
    for i in range(12):
        decision = router.route(query(chain(8) if i % 2 else chain(5, family=i + 10)))
        assert decision.rank != 1
        gbm.check_invariants()
    for rank in (0, 2, 3):
        gbm.mark_dead(rank)
    with pytest.raises(NoAliveRankError):
        router.route(query(chain(3)))


def test_bad_policy_config_and_topology_are_rejected():
    gbm = GlobalBlockManager(4, BLOCK)
    with pytest.raises(ValueError, match="lmpool, round_robin, least_loaded, sglang_cache_aware, dynamo_kv"):
        make_router(gbm, Topology.virtual(4), "random")
    with pytest.raises(ValueError, match="topology has 2 ranks"):
        make_router(gbm, Topology.virtual(2))
    with pytest.raises(ValueError, match="owner_min_match"):
        RoutingConfig(owner_min_match=1.0)
    with pytest.raises(ValueError, match="gate_rel_threshold"):
        RoutingConfig(gate_rel_threshold=0.5)
    with pytest.raises(ValueError, match="sglang_tree"):
        RoutingConfig(sglang_tree="radix")
    with pytest.raises(ValueError, match="reservation_ttl_s"):
        RoutingConfig(reservation_ttl_s=0)


# ---- baselines ----------------------------------------------------------------------------


def test_least_loaded_picks_min_of_four_waiting_plus_running():
    gbm, router = make(policy="least_loaded")
    cache(gbm, 3, chain(8))  # cache plays no part
    for rank, (waiting, running) in enumerate([(1, 0), (0, 3), (0, 5), (2, 0)]):
        load(gbm, rank, num_waiting=waiting, num_running=running)
    # Scores 4, 3, 5, 8; each route counts as one more waiting request until admitted.
    ranks = [router.route(query(chain(8))).rank for _ in range(3)]
    assert ranks == [1, 0, 2]
    assert router.route(query(chain(8))).reason == "least_loaded r1 score=7"


def test_round_robin_cycles_over_alive_candidates():
    gbm, router = make(policy="round_robin")
    assert [router.route(query(chain(2))).rank for _ in range(5)] == [0, 1, 2, 3, 0]
    gbm.mark_dead(2)
    assert [router.route(query(chain(2))).rank for _ in range(4)] == [1, 3, 0, 1]
    gbm, router = make(policy="round_robin", topology=Topology.from_pairs(4, [(0, 1), (2, 3)]))
    assert [router.route(query(chain(2)), seed_rank=2).rank for _ in range(3)] == [2, 3, 2]


# The older rule sets, which the first tests of each peer pin (``eval_policies.PEER_VARIANTS``).
SGLANG_V0 = dict(sglang_cache_threshold=0.5, sglang_balance_abs_threshold=32, sglang_balance_rel_threshold=1.0001,
                 sglang_miss_rule="smallest_tree", sglang_balance_rule="max_min")
DYNAMO_V0 = dict(dynamo_prefill_tokens="full", dynamo_assume_kv_reuse=False)


def test_sglang_routes_by_its_approximate_tree_when_balanced():
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0))
    a = chain(8, family=1)
    first = router.route(query(a, extra_tokens=0))
    assert first.rank == 0 and first.reason.startswith("sglang_smallest_tree r0")
    # The router's own tree now holds `a` under rank 0 (no worker has reported anything).
    again = router.route(query(a, extra_tokens=0))
    assert again.rank == 0 and again.reason == "sglang_cache r0 rate=1.00"
    other = router.route(query(chain(8, family=2)))
    assert other.reason.startswith("sglang_smallest_tree r1")
    # Cache threshold 0.5 is strict: half the prompt matched is not enough.
    half = RouteQuery("half", a[:4] + chain(4, family=3), 8 * BLOCK, 16)
    assert router.route(half).reason.startswith("sglang_smallest_tree r2 size=0 rate=0.50")
    # Above it, the longest tree match wins: ranks 0 and 2 both hold a[:4] now; rank 2 has the lower load.
    more = RouteQuery("more", a[:4] + chain(3, family=4), 7 * BLOCK, 16)
    assert router.route(more).reason == "sglang_cache r2 rate=0.57"


def test_sglang_switches_to_the_shortest_queue_past_both_balance_thresholds():
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0))
    a = chain(8)
    router.route(query(a))  # rank 0's tree holds `a`
    release_all(gbm)
    load(gbm, 0, num_waiting=32)  # max - min = 32: not above balance_abs_threshold
    assert router.route(query(a)).reason.startswith("sglang_cache r0")
    release_all(gbm)
    load(gbm, 0, num_waiting=33)
    assert router.route(query(a)).reason == "sglang_balance r1 load=0 max=33"
    release_all(gbm)
    # Relative threshold: 140 vs 100 is imbalanced at 1.0001, balanced at 1.5.
    for rank in range(4):
        load(gbm, rank, num_running=140 if rank == 0 else 100)
    assert router.route(query(a)).reason.startswith("sglang_balance r1")
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(**{**SGLANG_V0, "sglang_balance_rel_threshold": 1.5}))
    router.route(query(a))
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, num_running=140 if rank == 0 else 100)
    assert router.route(query(a)).reason.startswith("sglang_cache r0")


def test_sglang_can_read_the_page_table_instead():
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(**SGLANG_V0, sglang_tree="page_table"))
    cache(gbm, 2, chain(8))
    cache(gbm, 0, chain(1, family=5))
    decision = router.route(query(chain(8)))
    assert decision.rank == 2 and decision.reason.startswith("sglang_cache r2")
    # A miss goes to the rank with the smallest share of the page table.
    assert router.route(query(chain(3, family=7))).rank == 1


def dynamo_cost(gbm, rank, q, overlap, weight):
    info = gbm.ranks[rank]
    prefill = (info.load.waiting_prefill_tokens + info.reserved_tokens + q.num_prompt_tokens - overlap * BLOCK)
    decode = info.load.blocks_used + info.reserved_blocks + math.ceil(q.num_prompt_tokens / BLOCK)
    return weight * prefill / BLOCK + decode


def dynamo_setup(config=None):
    gbm, router = make(policy="dynamo_kv", config=config)
    cache(gbm, 0, chain(8))
    load(gbm, 0, blocks_used=50)
    load(gbm, 2, waiting_prefill_tokens=1000)
    load(gbm, 3, blocks_used=1)
    return gbm, router, query(chain(10)), [8, 0, 0, 0]


@pytest.mark.parametrize("weight, expected", [(1.0, 1), (10.0, 0)])
def test_dynamo_picks_the_minimum_cost(weight, expected):
    gbm, router, q, overlaps = dynamo_setup(RoutingConfig(**DYNAMO_V0, dynamo_overlap_score_weight=weight))
    costs = [dynamo_cost(gbm, r, q, overlaps[r], weight) for r in range(4)]
    assert min(range(4), key=costs.__getitem__) == expected
    decision = router.route(q)
    assert decision.rank == expected
    assert decision.reason == f"dynamo_min_cost r{expected} cost={costs[expected]:.1f}"


def test_dynamo_temperature_samples_by_normalized_softmax():
    gbm, router, q, overlaps = dynamo_setup(RoutingConfig(**DYNAMO_V0, dynamo_temperature=1.0, seed=7))
    costs = [dynamo_cost(gbm, r, q, overlaps[r], 1.0) for r in range(4)]
    lo, hi = min(costs), max(costs)
    weights = [math.exp(-(c - lo) / (hi - lo)) for c in costs]
    expected = [w / sum(weights) for w in weights]
    n = 3000
    counts = collections.Counter()
    for i in range(n):
        counts[router.route(RouteQuery(f"t{i}", q.block_hashes, q.num_prompt_tokens, 16)).rank] += 1
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
    gbm, router = make(policy="sglang_cache_aware")
    a = chain(10, family=1)
    router.route(query(a))  # rank 0's tree holds `a`; its reservation is load 1 there
    release_all(gbm)
    load(gbm, 0, num_running=3)
    load(gbm, 1, num_running=2)
    load(gbm, 2, num_running=1)
    load(gbm, 3, num_running=4)
    # 4 of 10 blocks matched (rate 0.4 > 0.3): a hit stays on the tree's owner despite its load.
    hit = RouteQuery("hit", a[:4] + chain(6, family=2), 10 * BLOCK, 16)
    assert router.route(hit).reason == "sglang_cache r0 rate=0.40"
    release_all(gbm)
    # 2 of 10 (0.2): a miss, to the least-loaded worker; every tree but rank 0's is empty.
    miss = RouteQuery("miss", a[:2] + chain(8, family=3), 10 * BLOCK, 16)
    assert router.route(miss).reason == "sglang_miss_least_loaded r2 load=1 rate=0.20"


def test_sglang_gateway_defaults_spill_a_hit_past_the_fleet_mean():
    """smg 1.13's spill gate: the matched worker is passed over once its load exceeds the fleet's
    mean by min(64, max(4, 2 * sqrt(mean))) and 1.5 times the mean."""
    gbm, router = make(policy="sglang_cache_aware")
    a = chain(8)
    router.route(query(a))  # rank 0's tree holds `a`
    # Rank 0 alone loaded, the others idle: mean = L / 4 and the margin 4 while L < 64, so the
    # gate opens from L = 6 (6 > 1.5 + 4), not at the old rule's gap of 65.
    for running, verdict in ((5, "sglang_cache r0"), (6, "sglang_spill r1 load=0 over r0 load=6")):
        release_all(gbm)
        load(gbm, 0, num_running=running)
        assert router.route(query(a)).reason.startswith(verdict)
    gbm, router = make(policy="sglang_cache_aware")
    router.route(query(a))
    # A busy fleet: mean 100.25, margin 2 * sqrt(mean) = 20.02; rank 0 at 121 passes the margin
    # but not 1.5 times the mean (150.4): it keeps its hit.
    release_all(gbm)
    for rank in range(4):
        load(gbm, rank, num_running=121 if rank == 0 else 93)
    assert router.route(query(a)).reason.startswith("sglang_cache r0")
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(sglang_balance_rel_threshold=1.0))
    router.route(query(a))
    release_all(gbm)
    for rank in range(4):  # mean 100.25 + 20.02 = 120.27: 121 spills, at ratio 1.0
        load(gbm, rank, num_running=121 if rank == 0 else 93)
    assert router.route(query(a)).reason.startswith("sglang_spill r1")


def test_sglang_older_balance_rule_switches_the_whole_pool_past_64_and_one_and_a_half_times():
    gbm, router = make(policy="sglang_cache_aware", config=RoutingConfig(sglang_balance_rule="max_min"))
    a = chain(8)
    router.route(query(a))
    for running, verdict in ((64, "sglang_cache r0"), (65, "sglang_balance r1")):
        release_all(gbm)
        load(gbm, 0, num_running=running)  # the others idle: a gap of 64 is not above the threshold
        assert router.route(query(a)).reason.startswith(verdict)
    release_all(gbm)
    for rank in range(4):  # a gap of 70, but 240 / 170 < 1.5: balanced
        load(gbm, rank, num_running=240 if rank == 0 else 170)
    assert router.route(query(a)).reason.startswith("sglang_cache r1")  # it holds `a` too now


def test_dynamo_charges_queued_requests_only_their_new_tokens_and_counts_shared_blocks_once():
    """Dynamo's defaults: a rank's queued prefill is its requests' prompts less their cached
    overlap (``LoadReport.new_prefill_tokens``), and a request adds to the decode term only the
    blocks it does not share with what the rank holds."""
    gbm, router = make(world=2, policy="dynamo_kv")
    cache(gbm, 0, chain(8))
    # Rank 0 queues requests that will hit its cache: 4,000 prompt tokens, 200 of them new.
    load(gbm, 0, blocks_used=10, waiting_prefill_tokens=4000, new_prefill_tokens=200)
    load(gbm, 1, blocks_used=10)
    q = query(chain(10))  # 10 blocks + 5 tokens: 11 blocks, 8 of them cached on rank 0
    prefill = {0: (200 + q.num_prompt_tokens - 8 * BLOCK) / BLOCK, 1: q.num_prompt_tokens / BLOCK}
    decode = {0: 10 + (11 - 8), 1: 10 + 11}
    cost = {r: prefill[r] + decode[r] for r in (0, 1)}
    decision = router.route(q)
    assert decision.rank == 0 and decision.reason == f"dynamo_min_cost r0 cost={cost[0]:.1f}"
    # The older copy charged rank 0 all 4,000 queued tokens and all 11 blocks: it goes to rank 1.
    gbm, router = make(world=2, policy="dynamo_kv", config=RoutingConfig(**DYNAMO_V0))
    cache(gbm, 0, chain(8))
    load(gbm, 0, blocks_used=10, waiting_prefill_tokens=4000, new_prefill_tokens=200)
    load(gbm, 1, blocks_used=10)
    assert router.route(query(chain(10))).rank == 1


def test_unknown_peer_rule_names_are_refused():
    with pytest.raises(ValueError, match="sglang_miss_rule"):
        RoutingConfig(sglang_miss_rule="random")
    with pytest.raises(ValueError, match="dynamo_prefill_tokens"):
        RoutingConfig(dynamo_prefill_tokens="some")
    with pytest.raises(ValueError, match="sglang_balance_rule"):
        RoutingConfig(sglang_balance_rule="mean")


def burst_over_two_documents(groups: bool, per_document: int = 32, system: bool = False,
                              seen: dict | None = None) -> dict[int, collections.Counter]:
    """Questions about two 16k-token documents cached on all 4 ranks, alternating, routed before
    any load report (step times at the prior's, cascades at the engine's default threshold): the
    questions of each document on each rank. ``system``: both documents open with the same block
    (a shared system prompt), then differ. ``seen``: filled with each route's document and the
    group its decision named, in order (``named``), and the page table (``gbm``)."""
    docs = [chain(1024, family=100 * (d + 1)) for d in range(2)]
    stored = chain_blocks(docs[0]) + chain_blocks(docs[1], first_id=1024)
    if system:
        docs = [[7] + doc[1:] for doc in docs]  # block 7 opens both
        stored = chain_blocks(docs[0]) + chain_blocks(docs[1], first_id=1024)[1:]
    gbm = GlobalBlockManager(4, BLOCK, reservation_ttl_s=60.0, clock=ManualClock())
    for rank in range(4):
        gbm.register_rank(rank, 1, 8192)
        gbm.apply_snapshot(rank, 1, KVSnapshot(1, stored))
        gbm.update_load(rank, 1, LoadReport(blocks_free=8192 - 2048))
    router = priced_router(gbm, Topology.virtual(4), "lmpool", RoutingConfig(cascade_groups=groups),
                           coefficients=DEFAULT_PRIOR,
                           limits=Limits(BLOCK, 256, 8192, True, CASCADE_MIN_SAVED_TOKENS, cascade_groups=groups))
    placed: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    named = []
    for i in range(per_document):
        for d, doc in enumerate(docs):
            decision = router.route(query(doc + chain(1, family=10_000 + 2 * i + d), max_tokens=256))
            placed[decision.rank][d] += 1
            named.append((d, decision.group))
    if seen is not None:
        seen.update(named=named, gbm=gbm)
    return placed


def test_with_cascade_groups_a_burst_over_two_cached_documents_decodes_one_document_per_rank():
    """A burst's questions join the rank already decoding their document (its prefix read once for
    them there) rather than open a second group on a rank decoding the other: with
    ``RoutingConfig.cascade_groups`` each rank ends with one document's questions, two ranks each;
    without it, the first questions of both spread over every rank, and every rank reads both."""
    grouped, spread = burst_over_two_documents(True), burst_over_two_documents(False)
    assert sorted(sorted(c.items()) for c in grouped.values()) == [[(0, 16)], [(0, 16)], [(1, 16)], [(1, 16)]]
    mixed = [rank for rank, c in spread.items() if len(c) == 2]
    assert len(mixed) == 4 and sum(c.total() for c in spread.values()) == 64


def queued_report(questions: list[tuple[str, bytes | None, int]], admitted: list[str], document: int,
                  free: int) -> LoadReport:
    """What a worker reports of ``questions`` (id, group, prompt tokens) queued behind a cached
    ``document`` of that many tokens, 64 new tokens and 32 to decode each (``Worker.load``): a
    question whose group has another member there counts the document as the cascade pairs it
    will attend, not as context it reads alone."""
    heads = collections.Counter(group for _, group, _ in questions)
    pairs = sum(document for _, group, _ in questions if heads[group] > 1)
    held = sum(prompt for _, _, prompt in questions)
    return LoadReport(num_waiting=len(questions), waiting_prefill_tokens=64 * len(questions),
                      new_prefill_tokens=64 * len(questions),
                      prefill_attention=sum(64 * (prompt - 64) + 64 * 65 // 2 for _, _, prompt in questions),
                      decode_tokens_left=32 * len(questions), context_tokens=held - pairs, blocks_free=free,
                      admitted=admitted, cascade_pairs=pairs, group_heads=list(heads), group_rows=list(heads.values()),
                      prefill_keys=held)


def test_with_cascade_groups_a_burst_stays_even_as_its_ranks_report_their_queued_questions():
    """128 questions over two 32k documents cached on all 4 ranks, in the order an H100 oracle run
    asked them, at that run's step fit, every rank reporting its queued questions every 16 routes
    (``queued_report``): each rank ends with 32 questions of one document. When the workers
    reported those questions' documents as context each read alone, a rank's report made it look
    several times dearer than its reservations had (on the GPU the two owners of the real trace
    froze at 26 and 25 questions; here one document split 30/34 over its two ranks)."""
    fit = StepCoefficients(base=3.33e-3, prefill_token=8.08e-6, attention_pair=2.37e-9, decode_seq=13.4e-6,
                           context_token=0.124e-6, cascade_pair=6.37e-9, prefill_key=184e-9)
    order = ("11100110010000101110000110000110010000010001001110000101000111010000001111111110001011110111111101"
             "011010001011110110100100111001")
    n = 2048  # blocks: 32k tokens
    docs = [chain(n, family=100 * (d + 1)) for d in range(2)]
    stored = chain_blocks(docs[0]) + chain_blocks(docs[1], first_id=n)
    gbm = GlobalBlockManager(4, BLOCK, reservation_ttl_s=60.0, clock=ManualClock())
    for rank in range(4):
        gbm.register_rank(rank, 1, 16384)
        gbm.apply_snapshot(rank, 1, KVSnapshot(1, stored))
        gbm.update_load(rank, 1, LoadReport(blocks_free=16384 - 2 * n))
    router = priced_router(gbm, Topology.virtual(4), "lmpool", RoutingConfig(cascade_groups=True), coefficients=fit,
                           limits=Limits(BLOCK, 256, 8192, True, CASCADE_MIN_SAVED_TOKENS, cascade_groups=True))
    queued: dict[int, list] = collections.defaultdict(list)
    admitted: dict[int, list] = collections.defaultdict(list)
    placed: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, d in enumerate(order):
        q = query(docs[int(d)] + chain(4, family=10_000 + i), extra_tokens=0, max_tokens=32)
        decision = router.route(q)
        placed[decision.rank][d] += 1
        queued[decision.rank].append((q.request_id, decision.group, q.num_prompt_tokens))
        admitted[decision.rank].append(q.request_id)
        if (i + 1) % 16 == 0:
            for rank in range(4):
                gbm.update_load(rank, 1, queued_report(queued[rank], admitted.pop(rank, []), n * BLOCK,
                                                       16384 - 2 * n - 3 * len(queued[rank])))
    assert sorted(sorted(c.items()) for c in placed.values()) == [[("0", 32)], [("0", 32)], [("1", 32)], [("1", 32)]]


def test_with_cascade_groups_a_decision_names_its_route_s_group_the_shared_prefix_s_last_block():
    """The burst, both documents opening with one system-prompt block: each decision names its
    route's group (``RouteDecision.group``, which its worker counts it under), as its reservation
    does: the last block of its document, the deepest of its prefix a rank holds, so the documents
    are groups apart although their first block is one, from each document's first question on
    (before any question branched from it, and although the other document's first question has
    branched from the system block). Each rank ends with one document's questions, and its reservations count the groups the
    decisions named (the rank's ``reserved.heads``), as its worker's load reports will. A pool that
    prices no groups names none."""
    seen: dict = {}
    grouped = burst_over_two_documents(True, system=True, seen=seen)
    assert sorted(sorted(c.items()) for c in grouped.values()) == [[(0, 16)], [(0, 16)], [(1, 16)], [(1, 16)]]
    named, gbm = seen["named"], seen["gbm"]
    last = {0: chain(1024, family=100)[-1], 1: chain(1024, family=200)[-1]}
    assert all(group == last[d] for d, group in named)
    reserved = sum((collections.Counter(gbm.ranks[r].reserved.heads) for r in range(4)), collections.Counter())
    assert reserved == collections.Counter(group for _, group in named if group is not None)
    plain: dict = {}
    burst_over_two_documents(False, per_document=2, system=True, seen=plain)
    assert [group for _, group in plain["named"]] == [None] * 4
