"""Routing latency on a large global page table (``python -m pytest benchmarks/test_bench_routing.py -s``).

8 ranks and 1,000,000 page-table entries: prompt families of 40-block chains
whose first 8 blocks are shared by 100 families (a system prompt), each family
cached on 2 or 3 ranks, added until the table holds 1,000,000 entries. Queries are
40-block chains: a cached family with a new tail, a shared stem with a new
tail, or a complete miss, in equal parts. Every route takes a reservation; the
ranks' load reports admit them in batches, as workers would, and their stored-block reports
confirm the admitted requests' pending prefixes (the table itself stays at its 1,000,000
entries: those blocks are not added to it). Timed per call with ``perf_counter_ns``: the
decision (``Router.decide``, what a request waits for) and, apart, the route's bookkeeping
after its reply (``Router.record``: reservation, pending prefix, demand), which the control
process runs before the next route. A route that opens a pull is answered only once the copy
has landed, milliseconds later, so the decisions are also summarised without those
(``answered_now_us``), and those apart (``pulled_us``); the pull's plan opens as its route is
recorded. Each policy routes the same queries and sees the same load reports; after an untimed
warm-up, the policies take turns, ``CHUNK`` queries at a time in a rotating order, so that
neither the order nor a noisy stretch of a shared machine favours one. Results go to ``benchmarks/results/routing_cpu.json`` (or
``LMPOOL_BENCH_JSON``).

Every policy is built as the control process builds it (``lmpool.control.build.assemble``),
its ranks' step times at the engine model's prior. ``lmpool+pull`` is the LMPool policy with
route-time pulls (``lmpool.control.transfers.pull``), priced wherever a route may leave its
owner: the plans it opens go nowhere and end (abort) with each batch of load reports, as they
would land within milliseconds in a pool. ``lmpool+all`` is transfer mode "all": pulls, and
background placement's per-route observation inside the timed call; its placement passes run between
routes, in slices, as the control loop runs them: after every batch of load reports a pass
over the chains routed since the last (a route's reaction), and every ``FULL_PASS_EVERY``
batches one over every remembered chain (the periodic pass). Slices are timed apart: a route
that arrives during a pass waits for the slice under way, never for the whole pass.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import msgspec
import pytest

from lmpool.config.pool import PoolConfig
from lmpool.control.build import assemble
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.pending import CountPending
from lmpool.control.routing.registry import POLICIES
from lmpool.protocol.kv_events import BlockStored, KVSnapshot
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.spec import ControlSpec

WORLD, BLOCK, CHAIN = 8, 256, 40
STEM_BLOCKS, FAMILIES_PER_STEM = 8, 100
TARGET_ENTRIES = 1_000_000
QUERIES, WARMUP, ADMIT_EVERY = 20_000, 2_048, 64
CHUNK = 2_048  # timed queries a policy routes before the next policy's turn (a multiple of ADMIT_EVERY)
FULL_PASS_EVERY = 64  # batches of reports: every 4,096 routes, about 0.1 s of routing
RESULT = Path(os.environ.get("LMPOOL_BENCH_JSON", Path(__file__).parent / "results" / "routing_cpu.json"))


def build(rng: random.Random) -> tuple[GlobalBlockManager, list[list[int]], list[list[int]], int, float]:
    """The page table, its families and stems, its distinct hash count, and the seconds taken to apply it."""
    stems: list[list[int]] = []
    families: list[list[int]] = []
    per_rank: list[dict[int, int]] = [{} for _ in range(WORLD)]  # hash -> parent hash
    total = 0
    while total < TARGET_ENTRIES:
        if len(families) % FAMILIES_PER_STEM == 0:
            stems.append([rng.getrandbits(64) for _ in range(STEM_BLOCKS)])
        chain = stems[-1] + [rng.getrandbits(64) for _ in range(CHAIN - STEM_BLOCKS)]
        families.append(chain)
        for rank in rng.sample(range(WORLD), 2 + len(families) % 2):
            parent = 0
            for h in chain:
                if h not in per_rank[rank] and total < TARGET_ENTRIES:
                    per_rank[rank][h] = parent
                    total += 1
                parent = h
    distinct = len(set().union(*per_rank))
    gbm = GlobalBlockManager(WORLD, BLOCK)
    start = time.perf_counter()
    for rank, blocks in enumerate(per_rank):
        gbm.register_rank(rank, 0, 200_000)
        snapshot = KVSnapshot(1, [BlockStored(h, p, i, 1) for i, (h, p) in enumerate(blocks.items())])
        gbm.apply_snapshot(rank, 0, snapshot)
    build_s = time.perf_counter() - start
    return gbm, families, stems, distinct, build_s


def queries(rng: random.Random, families: list[list[int]], stems: list[list[int]]) -> list[RouteQuery]:
    out = []
    for i in range(QUERIES + WARMUP):
        kind = i % 3
        if kind == 0:  # cached family, new tail
            keep = rng.randrange(STEM_BLOCKS, CHAIN)
            chain = rng.choice(families)[:keep]
        elif kind == 1:  # shared stem, new tail
            chain = list(rng.choice(stems))
        else:  # miss
            chain = []
        chain = chain + [rng.getrandbits(64) for _ in range(CHAIN - len(chain))]
        out.append(RouteQuery(f"q{i}", chain, CHAIN * BLOCK + rng.randrange(BLOCK), 256))
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class Routes:
    """One policy's route path: ``route(query)`` is the timed call; ``between()`` runs what the
    control loop runs between routes (placement passes), timed apart; ``end_plans()`` aborts
    the plans the benchmark's transfers open, which go nowhere."""

    def __init__(self, gbm: GlobalBlockManager, policy: str) -> None:
        routing, _, mode = policy.partition("+")
        pool = PoolConfig.from_options("unused", world_size=WORLD, device="cpu", block_size=BLOCK, routing=routing,
                                       transfer_mode=mode or "none")
        spec = ControlSpec(pool=pool, frontend_end="unused", worker_ends=["unused"] * WORLD,
                           kv_bytes_per_block=1 << 20)

        def plan_ended(plan) -> None:
            parts.policies.plan_ended(plan)

        parts = assemble(spec, gbm, lambda rank, order: None, plan_ended, lambda plan: None,
                         lambda request_id, outcome: None)
        self.router, self.coordinator = parts.router, parts.coordinator
        self.policies = parts.policies if pool.transfer.background_placement else None
        self.pending = next((s.pending for s in self.router.stages if isinstance(s, CountPending)), None)

    def prefilled(self, rank: int, queries: list[RouteQuery]) -> None:
        """``queries``, admitted on ``rank``, have prefilled: the rank's stored-block reports
        confirm their pending blocks (the page table itself stays at its fixed size)."""
        if self.pending is not None:
            for q in queries:
                for h in q.block_hashes:
                    self.pending.confirm(rank, h)

    def route(self, query: RouteQuery):
        return self.router.decide(query)

    def record(self) -> None:
        self.router.record()

    def between(self, full: bool) -> tuple[list[float], float] | None:
        """One placement pass in the control process's slices: each slice's microseconds, and the
        pass's; None where the policy places nothing."""
        if self.policies is None:
            return None
        budget = self.policies.cfg.placement_slice_s
        slices = []
        while True:
            start = time.perf_counter_ns()
            over = self.policies.tick(budget, fresh_only=not full)
            slices.append((time.perf_counter_ns() - start) / 1e3)
            if over:
                return slices, sum(slices)

    def end_plans(self) -> None:
        for plan_id in list(self.coordinator.plans):
            self.coordinator.abort(plan_id, "the benchmark's plans end with each batch of reports")


class PolicyRun:
    """One policy's routes over the query stream, run in chunks that the benchmark interleaves
    with the other policies' (so a noisy second of the machine falls on every policy alike):
    the microseconds of each timed decision and record, how often each rule decided, and the
    microseconds of each placement slice and pass. Every chunk ends with every rank admitting
    what was routed to it (the page table holds no reservation between chunks) and starts from
    the policy's own last load reports, drawn from its own generator: every policy sees the
    same loads."""

    def __init__(self, gbm: GlobalBlockManager, policy: str) -> None:
        self.gbm, self.policy = gbm, policy
        self.routes = Routes(gbm, policy)
        self.rng = random.Random(1)
        self.loads: list[LoadReport] = [LoadReport(blocks_free=200_000)] * WORLD
        self.routed = 0
        self.times: list[float] = []
        self.records: list[float] = []
        self.pulls: list[bool] = []
        self.slices: list[float] = []
        self.passes: list[float] = []
        self.rules: collections.Counter = collections.Counter()

    def run(self, qs: list[RouteQuery], timed: bool) -> None:
        gbm, routes = self.gbm, self.routes
        for rank, load in enumerate(self.loads):
            gbm.update_load(rank, 0, load)
        pending: list[list[RouteQuery]] = [[] for _ in range(WORLD)]
        for q in qs:
            start = time.perf_counter_ns()
            decision = routes.route(q)
            decided = time.perf_counter_ns()
            routes.record()
            recorded = time.perf_counter_ns()
            if timed:
                self.times.append((decided - start) / 1e3)
                self.records.append((recorded - decided) / 1e3)
                rule = decision.reason.split()[0]
                self.rules[rule] += 1
                self.pulls.append(rule == "pull")
            pending[decision.rank].append(q)
            self.routed += 1
            if self.routed % ADMIT_EVERY == 0:  # every rank reports what it admitted (not timed)
                self._report(pending)
                placed = routes.between(full=self.routed // ADMIT_EVERY % FULL_PASS_EVERY == 0)
                if placed is not None and timed:
                    self.slices += placed[0]
                    self.passes.append(placed[1])
        self._report(pending)

    def _report(self, pending: list[list[RouteQuery]]) -> None:
        """Every rank's load report, admitting what was routed there; the plans opened end."""
        self.routes.end_plans()
        rng = self.rng
        for rank in range(WORLD):
            load = LoadReport(
                num_waiting=rng.randrange(8), num_running=rng.randrange(64),
                waiting_prefill_tokens=(queued := rng.randrange(20_000)), new_prefill_tokens=queued // 2,
                decode_tokens_left=rng.randrange(50_000),
                context_tokens=rng.randrange(500_000),
                blocks_free=rng.randrange(50_000), blocks_reclaimable=rng.randrange(100_000),
                blocks_used=rng.randrange(50_000), admitted=[q.request_id for q in pending[rank]],
            )
            self.gbm.update_load(rank, 0, load)
            self.routes.prefilled(rank, pending[rank])
            pending[rank] = []
            self.loads[rank] = msgspec.structs.replace(load, admitted=[])


@pytest.mark.slow
def test_route_latency_1m_entries():
    rng = random.Random(0)
    gbm, families, stems, distinct, build_s = build(rng)
    assert gbm.num_entries() == TARGET_ENTRIES
    qs = queries(rng, families, stems)
    hits = sum(1 for q in qs[WARMUP:] if gbm.ready_ranks(q.block_hashes[0]))
    results = {}
    # Importing lmpool imports torch: a full collection over its objects (and this test's query lists)
    # stalls any Python code for ~100 ms, whatever it is doing. Freeze the start-up heap, as a
    # long-lived control process should, so the figures are routing's own.
    gc.collect()
    gc.freeze()
    load_before = os.getloadavg()[0]
    policies = (*POLICIES, "lmpool+pull", "lmpool+all")
    runs = {policy: PolicyRun(gbm, policy) for policy in policies}
    for run in runs.values():  # each policy's warm-up, untimed
        run.run(qs[:WARMUP], timed=False)
    # The timed queries in chunks, the policies in a rotating order chunk by chunk: a policy
    # timed first paid for the warm-up of the interpreter's caches (on the H200 host LMPool
    # routing only, timed first, had a higher p50 than the default, which decides the same
    # and more), and a noisy stretch of a shared machine fell on one policy.
    timed = qs[WARMUP:]
    for n, at in enumerate(range(0, len(timed), CHUNK)):
        order = policies[n % len(policies):] + policies[:n % len(policies)]
        for policy in order:
            runs[policy].run(timed[at:at + CHUNK], timed=True)
    for policy, run in runs.items():
        times, pulls, rules = run.times, run.pulls, run.rules
        now = [t for t, pulled in zip(times, pulls) if not pulled]
        results[policy] = summary(times) | {"answered_now_us": summary(now), "record_us": summary(run.records),
                                            "rules": dict(rules.most_common())}
        if len(now) < len(times):  # the routes that open a pull, apart: the default's tail
            results[policy]["pulled_us"] = summary([t for t, pulled in zip(times, pulls) if pulled])
        line = (f"{policy:>20}: p50 {results[policy]['p50_us']:7.2f} us  p99 {results[policy]['p99_us']:7.2f} us"
                f"  (answered at once p99 {results[policy]['answered_now_us']['p99_us']:7.2f})"
                f"  record p50 {results[policy]['record_us']['p50_us']:6.2f} p99 {results[policy]['record_us']['p99_us']:6.2f}")
        if run.passes:
            results[policy]["placement_slice_us"] = summary(run.slices) | {"slices": len(run.slices)}
            results[policy]["placement_pass_us"] = summary(run.passes) | {"passes": len(run.passes)}
            line += f"  placement slice p99 {results[policy]['placement_slice_us']['p99_us']:.1f} us" \
                    f" pass p50 {results[policy]['placement_pass_us']['p50_us']:.1f} us"
        print(f"{line}  {dict(rules.most_common())}")
    gbm.check_invariants()
    gc.unfreeze()
    print(f"build {build_s:.2f} s for {gbm.num_entries():,} entries, {distinct:,} distinct hashes")
    data = {
        "world_size": WORLD,
        "block_size": BLOCK,
        "chain_blocks": CHAIN,
        "page_table_entries": gbm.num_entries(),
        "distinct_hashes": distinct,
        "build_s": round(build_s, 2),
        "queries": QUERIES,
        "queries_hitting_cache": hits,
        "route_us": results,
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_model": _cpu_model(),  # absolute figures differ across CPUs several-fold
            "cpus": os.cpu_count(),
            # Other processes share the machine: the 1-minute load average around the timed runs.
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(data, indent=2) + "\n")
    assert results["lmpool"]["p99_us"] <= 100, "route p99 above the 100 us goal"
    assert results["lmpool+pull"]["p99_us"] <= 100, "the default's route p99 (transfer mode pull) above the 100 us goal"
    assert results["lmpool+all"]["p99_us"] - results["lmpool"]["p99_us"] <= 100, "pulls and placement add over 100 us p99"
    assert results["lmpool+all"]["placement_slice_us"]["p99_us"] <= 100, "a route waits over 100 us for placement"


def summary(micros: list[float]) -> dict:
    ordered = sorted(micros)
    return {"p50_us": round(percentile(ordered, 0.50), 2), "p99_us": round(percentile(ordered, 0.99), 2),
            "max_us": round(ordered[-1], 2), "mean_us": round(statistics.fmean(ordered), 2)}


def _cpu_model() -> str:
    """The CPU's model name where the system says it (Linux), else the platform's processor."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
