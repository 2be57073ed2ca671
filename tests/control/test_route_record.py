"""Router.decide and Router.record: a route's bookkeeping after its reply. Whatever the order of
decisions, records and rank losses, the routes and the state they leave (reservations, pending
prefixes, the policy's memory) are those of ``route``, which does both at once; at most one
decided route is ever unrecorded, and none across a decision or a rank going down."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.kv_events import KVSnapshot
from control_testkit import ManualClock, cache, pending_of, priced_router

BLOCK, WORLD, BLOCKS = 16, 3, 400


def pool(policy: str):
    gbm = GlobalBlockManager(WORLD, BLOCK, reservation_ttl_s=5.0, clock=ManualClock())
    for rank in range(WORLD):
        gbm.register_rank(rank, 1, BLOCKS)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        gbm.update_load(rank, 1, LoadReport(blocks_free=BLOCKS))
    cache(gbm, 1, [1001 + i for i in range(6)])
    return gbm, priced_router(gbm, Topology.virtual(WORLD), policy, None)


def state(router) -> tuple:
    gbm = router.gbm
    pending = pending_of(router)
    held = None if pending is None else [list(entries) for entries in pending._ranks]
    return ({rid: (r.rank, r.tokens, r.blocks) for rid, r in gbm.reservations.items()}, held,
            [gbm.ranks[r].alive for r in range(WORLD)])


ops = st.lists(st.one_of(
    st.tuples(st.just("decide"), st.integers(0, 3), st.integers(1, 8)),
    st.tuples(st.just("record"), st.just(0), st.just(0)),
    st.tuples(st.just("down"), st.integers(0, WORLD - 1), st.just(0)),
), max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from(["lmpool", "sglang_cache_aware", "round_robin"]))
def test_deciding_then_recording_leaves_what_routing_leaves(steps, policy):
    _, split = pool(policy)
    _, whole = pool(policy)
    for i, (op, a, b) in enumerate(steps):
        if op == "decide":
            q = RouteQuery(f"q{i}", [a * 1000 + 1001 + k for k in range(b)], b * BLOCK + 3, 8)
            if not any(split.gbm.ranks[r].alive for r in range(WORLD)):
                continue
            assert split.decide(q) == whole.route(q)
            assert f"q{i}" not in split.gbm.reservations  # its bookkeeping waits for record
        elif op == "record":
            split.record()
            assert state(split) == state(whole)
        else:
            split.rank_down(a)
            whole.rank_down(a)
            assert state(split) == state(whole)
    split.record()
    assert state(split) == state(whole)
    split.gbm.check_invariants()
