"""Every routing policy, replayed: a seeded stream of routes, worker reports, deaths, restarts,
in-flight markers and lease grants through the page table and the router. The peers' digest
is the one their routing gave before LMPool's rule was priced in seconds (at bedba43, the
peers pinned to their older rule sets; the LMPool variants left out, and the runs with
placement leases, which now steer only priced routes, as no peer runs with placement);
LMPool's is its own. A change that moves any route, matched count, reason,
reservation or heat changes one of them. Update a digest only for an intended routing change
of that side, and say so."""

from __future__ import annotations

import hashlib
import random

from lmpool.config import RoutingConfig
from lmpool.control.build import make_router
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.topology import Topology
from lmpool.control.transfers.leases import PlacementLeases, SteerToLeases
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVSnapshot

PEERS_DIGEST = "aa52d3175df3fd43521e5fec92dbb5567ca666119688db0a4ed0bcd68482d7f3"
LMPOOL_DIGEST = "db07881cd35146c36254c76d073c849214074283f5d2c96fa1aa01ce2ef0cb11"


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


VARIANTS = [
    ("lmpool", {}),
    ("lmpool", {"pending_ttl_s": 0.0}),
    ("lmpool", {"owner_min_match": 0.0, "gate_abs_threshold": 8}),
    ("round_robin", {}),
    ("least_loaded", {}),
    ("sglang_cache_aware", {}),
    ("sglang_cache_aware", {"sglang_tree": "page_table"}),
    ("sglang_cache_aware", {"sglang_max_tree_blocks": 40, "sglang_balance_abs_threshold": 4}),
    ("dynamo_kv", {}),
    ("dynamo_kv", {"dynamo_temperature": 0.7, "seed": 3}),
    ("dynamo_kv", {"dynamo_overlap_score_weight": 4.0}),
]


def replay(side: str) -> list[str]:
    """The replay's lines for the peers' variants ("peers", without leases) or LMPool's ("lmpool")."""
    out = []
    for vi, (policy, cfg) in enumerate(VARIANTS):
        if (policy == "lmpool") != (side == "lmpool"):
            continue
        for use_leases in (False, True) if side == "lmpool" else (False,):
            rng = random.Random(vi * 10 + use_leases)
            clock = Clock()
            W, B = 4, 8
            gbm = GlobalBlockManager(W, B, reservation_ttl_s=5.0, clock=clock, heat_half_life_s=10.0)
            topo = Topology.from_pairs(W, [(0, 1), (2, 3)])
            leases = PlacementLeases(30.0, clock=clock) if use_leases else None
            steering = SteerToLeases(leases) if use_leases else None
            v0 = {}
            if policy == "sglang_cache_aware":
                v0 = dict(
                    sglang_cache_threshold=0.5,
                    sglang_balance_abs_threshold=32,
                    sglang_balance_rel_threshold=1.0001,
                    sglang_miss_rule="smallest_tree",
                    sglang_balance_rule="max_min",
                )
            if policy == "dynamo_kv":
                v0 = dict(dynamo_prefill_tokens="full", dynamo_assume_kv_reuse=False)
            config = RoutingConfig(**{**v0, **cfg})
            router = make_router(gbm, topo, policy, config, steering=steering)
            epochs = [1] * W
            versions = [0] * W
            held = [dict() for _ in range(W)]  # hash -> (block_id, gen)
            for r in range(W):
                gbm.register_rank(r, 1, 200)
                gbm.apply_snapshot(r, 1, KVSnapshot(0, []))
            families = [[f * 1000 + i for i in range(1, 30)] for f in range(1, 12)]
            routed = {r: [] for r in range(W)}
            nid = 0
            for step in range(1500):
                clock.now += rng.choice([0.0, 0.01, 0.1, 0.5, 2.0])
                k = rng.random()
                if k < 0.45:
                    fam = rng.choice(families)
                    n = rng.randrange(1, len(fam))
                    hashes = fam[:n] + [rng.getrandbits(40) for _ in range(rng.randrange(0, 4))]
                    nid += 1
                    q = RouteQuery(
                        f"q{nid}", hashes, len(hashes) * B + rng.randrange(B), rng.choice([4, 16, 64])
                    )
                    seed = rng.choice([None, None, rng.randrange(W)])
                    try:
                        d = router.route(q, seed)
                        out.append(
                            f"{vi} {use_leases} route {q.request_id} {d.rank} {d.matched_blocks} {d.reason}"
                        )
                        routed[d.rank].append(q.request_id)
                    except Exception as e:
                        out.append(f"{vi} {use_leases} route-error {type(e).__name__} {e}")
                elif k < 0.65:
                    r = rng.randrange(W)
                    if not gbm.ranks[r].alive:
                        continue
                    adm = [x for x in routed[r] if rng.random() < 0.7]
                    routed[r] = [x for x in routed[r] if x not in adm]
                    load = LoadReport(
                        num_waiting=rng.randrange(40),
                        num_running=rng.randrange(60),
                        waiting_prefill_tokens=(queued := rng.randrange(4000)),
                        # LMPool queues the new tokens; the peers' digest was recorded from reports
                        # without them (Dynamo's rule reads them: its routes would move).
                        new_prefill_tokens=queued if policy == "lmpool" else 0,
                        decode_tokens_left=rng.randrange(5000),
                        blocks_free=rng.randrange(0, 200),
                        blocks_reclaimable=rng.randrange(0, 100),
                        blocks_used=rng.randrange(200),
                        admitted=adm,
                    )
                    gbm.update_load(r, epochs[r], load)
                elif k < 0.85:
                    r = rng.randrange(W)
                    if not gbm.ranks[r].alive:
                        continue
                    events = []
                    for _ in range(rng.randrange(1, 8)):
                        if held[r] and rng.random() < 0.3:
                            h = rng.choice(sorted(held[r]))
                            bid, g = held[r].pop(h)
                            events.append(BlockRemoved(h, bid, g))
                        else:
                            fam = rng.choice(families)
                            i = rng.randrange(len(fam))
                            h = fam[i]
                            bid = rng.randrange(1000)
                            g = rng.randrange(1, 4)
                            held[r][h] = (bid, g)
                            events.append(BlockStored(h, fam[i - 1] if i else 0, bid, g))
                    ok = gbm.apply_delta(
                        r, epochs[r], KVDelta(versions[r], versions[r] + len(events), events)
                    )
                    versions[r] += len(events)
                    out.append(f"{vi} {use_leases} delta {r} {ok}")
                elif k < 0.9:
                    r = rng.randrange(W)
                    if not gbm.ranks[r].alive:
                        continue
                    fam = rng.choice(families)
                    n = rng.randrange(1, len(fam))
                    held[r] = {h: (i, 1) for i, h in enumerate(fam[:n])}
                    versions[r] += 1
                    gbm.apply_snapshot(
                        r,
                        epochs[r],
                        KVSnapshot(versions[r], [BlockStored(h, 0, i, 1) for h, (i, _) in held[r].items()]),
                    )
                elif k < 0.93:
                    r = rng.randrange(W)
                    if gbm.ranks[r].alive and rng.random() < 0.5:
                        router.rank_down(r)
                        held[r] = {}
                        routed[r] = []
                        out.append(f"{vi} {use_leases} down {r}")
                    elif not gbm.ranks[r].alive:
                        epochs[r] += 1
                        versions[r] = 0
                        gbm.rank_up(r, epochs[r])
                        gbm.apply_snapshot(r, epochs[r], KVSnapshot(0, []))
                elif k < 0.95:
                    r = rng.randrange(W)
                    if not gbm.ranks[r].alive:
                        continue
                    fam = rng.choice(families)
                    h = fam[rng.randrange(len(fam))]
                    if rng.random() < 0.5:
                        out.append(
                            f"{vi} {use_leases} mark {gbm.mark_in_flight(r, h, 500 + rng.randrange(100), 1)}"
                        )
                    else:
                        gbm.unmark_in_flight(r, h, rng.random() < 0.5)
                elif use_leases:
                    r = rng.randrange(W)
                    for fam in rng.sample(families, len(families)):
                        depth = gbm.prefix_match(fam, 1 << r)[r]
                        if depth:
                            leases.grant(fam[depth - 1], rng.randrange(1, depth + 1), (r + 1) % W, r)
                            break
            gbm.check_invariants()
            out.append(
                f"{vi} {use_leases} end reservations {sorted((k, v.rank, v.blocks, v.tokens) for k, v in gbm.reservations.items())}"
            )
            if policy == "lmpool":
                out.append(f"{vi} {use_leases} end lease_routed {steering.routed if steering else 0} loads "
                           f"{[round(router.policy.pricer.load_s(r), 9) for r in range(W)]}")
            out.append(
                f"{vi} {use_leases} end heat {[round(gbm.heat(h), 9) for f in families for h in f[:5]]}"
            )
            out.append(
                f"{vi} {use_leases} counters {gbm.snapshots_applied} {gbm.deltas_applied} {gbm.gaps} {gbm.stale_rejected} {gbm.num_entries()}"
            )
    return out


def test_the_peers_route_as_they_did_before_lmpool_was_priced_in_seconds():
    assert hashlib.sha256("\n".join(replay("peers")).encode()).hexdigest() == PEERS_DIGEST


def test_lmpool_routes_as_its_digest_says():
    assert hashlib.sha256("\n".join(replay("lmpool")).encode()).hexdigest() == LMPOOL_DIGEST
