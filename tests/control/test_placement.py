"""Background placement: hotness from routed demand, the deepest hot prefix of each chain, every
gate refusing on its own, per-chain and per-pair caps, coalescing, a pass run in slices, and a
hypothesis state machine checking the batch invariants after every pass, whole or sliced with
other events between its slices."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.transfers.placement import BackgroundPlacement, HotChains, hot_depth
from lmpool.control.topology import Topology
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVSnapshot
from lmpool.protocol import LoadReport
from lmpool.control.transfers.admission import AdmissionGate, AdmissionPolicy
from lmpool.control.transfers.coordinator import TransferCoordinator
from lmpool.control.transfers.cost_model import TransferCostModel
from control_testkit import ManualClock, priced_router

BLOCK = 16
NUM_BLOCKS = 100


class World:
    """A page table, router and coordinator for ``n`` ranks, with a placement policy on top."""

    def __init__(self, n: int = 2, max_blocks: int = 8, batch_max: int = 128, prefill: float = 1e-3,
                 skew: float = 1e-3, topology: Topology | None = None) -> None:
        self.clock = ManualClock(1000.0)
        self.gbm = GlobalBlockManager(n, BLOCK, clock=self.clock, heat_half_life_s=10.0, route_hit_weight=0.5)
        self.sent = []
        self.coord = TransferCoordinator(self.gbm, lambda r, m: self.sent.append((r, m)), clock=self.clock)
        topology = topology or Topology.virtual(n)
        chains = HotChains(256)
        # Loads in seconds at 10 us a queued prefill token (``control_testkit.COEF``): 1,000 tokens
        # queued are 11 ms of work, 950 are 10.5 ms.
        self.pricer = priced_router(self.gbm, topology).policy.pricer
        # 1 ms + 1 MB/s over 4 KiB blocks: ~1 ms per block at these sizes.
        self.gate = AdmissionGate(AdmissionPolicy(prefill_s_per_token=prefill, block_size=BLOCK),
                                  TransferCostModel.uncalibrated(4096, 1e-3, 4e6))
        self.prefill = prefill
        self.placement = BackgroundPlacement(
            self.gbm, topology, self.pricer.load_s, self.coord, self.gate, lambda rank: self.prefill,
            chains, hot_threshold=2.0, min_load_skew_s=skew, cooldown_s=30.0, max_blocks=max_blocks,
            batch_max_blocks=batch_max,
        )
        self.versions = [0] * n
        for r in range(n):
            self.gbm.register_rank(r, 1, NUM_BLOCKS)
            self.gbm.apply_snapshot(r, 1, KVSnapshot(0, []))
            self.load(r)

    def cache(self, rank: int, *chains: list[int]) -> None:
        blocks, seen = [], set()
        for chain in chains:
            for i, h in enumerate(chain):
                if h not in seen:
                    seen.add(h)
                    blocks.append(BlockStored(h, chain[i - 1] if i else ROOT_HASH, len(blocks), 7))
        self.versions[rank] += 1
        self.gbm.apply_snapshot(rank, 1, KVSnapshot(self.versions[rank], blocks))

    def load(self, rank: int, waiting_prefill_tokens: int = 0, blocks_free: int = NUM_BLOCKS) -> None:
        self.gbm.update_load(rank, 1, LoadReport(waiting_prefill_tokens=waiting_prefill_tokens,
                                                 new_prefill_tokens=waiting_prefill_tokens, blocks_free=blocks_free))

    def route(self, chain: list[int], times: int = 1, rank: int = 0) -> None:
        """Routes of ``chain`` to ``rank``, as the pipeline records them (demand, placement's chains)."""
        for _ in range(times):
            matched = self.gbm.prefix_match(chain)
            self.gbm.record_route(chain, max(matched), matched[rank])
            self.placement.chains.observe(chain, max(matched))


def chain(n: int, family: int) -> list[int]:
    return [family * 1000 + i for i in range(1, n + 1)]


def hot_on_rank0(world: World, c: list[int], times: int = 2) -> None:
    """``c`` cached on rank 0 only, rank 0 loaded, routed ``times`` times (all land on rank 0)."""
    world.cache(0, c)
    world.load(0, waiting_prefill_tokens=1000)
    world.route(c, times)
    world.load(0, waiting_prefill_tokens=1000)


# ---- hotness ------------------------------------------------------------------------------


def test_heat_counts_accesses_weighs_route_hits_and_decays():
    w = World()
    c = chain(3, 1)
    w.cache(0, c[:2])
    w.route(c)  # rank 0 holds 2 blocks and the route used both: 1 + 0.5 each
    assert w.gbm.heat(c[0]) == pytest.approx(1.5) and w.gbm.heat(c[2]) == 0.0
    w.route(c, rank=1)  # a route to rank 1, which holds none of it: an access, not a hit
    assert w.gbm.hash_stats(c[0]).route_hits == 1 and w.gbm.heat(c[0]) == pytest.approx(2.5)
    w.clock.now += 10.0  # one half-life
    assert w.gbm.heat(c[0]) == pytest.approx(1.25)


def test_heat_stays_exact_across_scaling_epochs():
    """Heat is stored scaled by 2 ** (half-lives since a base); the base moves before that
    overflows, and older entries are rescaled when met."""
    w = World()
    c = chain(2, 1)
    w.cache(0, c)
    w.route(c)
    for _ in range(4):  # 4 x 100 half-lives: past an epoch boundary
        w.clock.now += 1000.0
        w.route(c)
    w.clock.now += 10.0
    assert w.gbm.heat(c[0]) == pytest.approx(1.5 / 2, rel=1e-9), "only the latest access still counts"
    assert len(w.gbm._heat._bases) > 1


def test_a_pass_takes_the_deepest_hot_prefix_once_and_forgets_cold_chains():
    w = World()
    a, cold, gone = chain(3, 1), chain(2, 2), chain(2, 3)
    w.cache(0, a, cold)
    w.load(0, waiting_prefill_tokens=1000)
    w.route(a, 2)  # 1.5 heat per route on every block of a
    w.route(cold, 1)  # 1.5: never hot
    w.placement.chains.observe(gone, held=2)  # routed while held, since evicted everywhere: no heat
    w.placement.chains.observe(chain(2, 4), held=0)  # nothing held anywhere: not a candidate
    w.load(0, waiting_prefill_tokens=1000)
    (batch,) = w.placement.tick()
    assert batch.hashes == a and batch.leases == [(a[-1], 3)], "a is hot to its leaf: copied whole, once"
    assert w.placement.chains.newest_first() == [cold, a], \
        "the chain whose root nobody holds is forgotten; the merely cold one is kept"
    chains = HotChains(capacity=3)
    for leaf in (11, 12, 13, 14):
        chains.observe([leaf], 1)
    assert chains.newest_first() == [[14], [13], [12]], "bounded: the oldest chain goes"


@pytest.mark.parametrize("heats", [[], [5.0], [1.0], [5, 4, 3, 2, 1], [2, 2, 2, 2], [9, 1, 1], [3, 2, 2, 1.99, 0]])
def test_the_deepest_hot_block_is_found_by_bisection(heats):
    blocks = list(range(len(heats)))
    linear = max((i + 1 for i, h in enumerate(heats) if h >= 2.0), default=0)
    assert hot_depth(blocks, lambda h: heats[h], 2.0) == linear


# ---- a copy, and each gate refusing --------------------------------------------------------


def test_a_hot_chain_on_a_loaded_rank_is_copied_to_its_idle_partner():
    w = World(max_blocks=2)
    c = chain(3, 1)
    hot_on_rank0(w, c)
    (batch,) = w.placement.tick()
    assert (batch.src, batch.dst) == (0, 1)
    assert batch.hashes == c[:2] and batch.parents == [ROOT_HASH, c[0]] and batch.generations == [7, 7]
    assert batch.leases == [(c[1], 2)]
    decision = w.placement.decisions[0]
    assert decision.admitted and decision.kind == "background" and decision.num_blocks == 2
    assert decision.saved_prefill_s == pytest.approx(2 * BLOCK * w.prefill)


def test_the_copy_continues_where_the_destination_match_ends():
    w = World(max_blocks=2)
    c = chain(5, 1)
    hot_on_rank0(w, c)
    w.cache(1, c[:2])
    (batch,) = w.placement.tick()
    assert batch.hashes == c[2:4] and batch.parents == c[1:3]


def test_a_copy_short_of_the_leaf_goes_on_next_tick_and_a_complete_one_does_not_cool_down():
    w = World(max_blocks=2)
    c = chain(5, 1)
    hot_on_rank0(w, c)
    (first,) = w.placement.tick()
    assert first.hashes == c[:2] and not w.placement.cooling, "stopped short of the leaf: no cooldown"
    for block_id, h in enumerate(first.hashes):  # the plan is on its way
        w.gbm.mark_in_flight(1, h, block_id, 1)
    assert w.placement.tick() == [] and w.placement.refused == {"destination_holds": 1}
    w.cache(1, c[:2])  # ... and has landed
    for h in first.hashes:
        w.gbm.unmark_in_flight(1, h, published=True)
    w.route(c, 2)
    (second,) = w.placement.tick()
    assert second.hashes == c[2:4] and second.leases == [(c[3], 4)]
    w.cache(1, c[:4])
    w.route(c, 2)
    (last,) = w.placement.tick()
    assert last.hashes == [c[4]] and c[4] not in w.placement.cooling, "a hot chain is never held back"
    w.cache(1, c)
    w.route(c, 2)
    assert w.placement.tick() == [] and w.placement.refused["destination_holds"] == 2


def refusal(setup) -> dict:
    w = World()
    c = chain(3, 1)
    hot_on_rank0(w, c)
    setup(w, c)
    assert w.placement.tick() == []
    return dict(w.placement.refused)


def test_cooldown_holds_a_refused_chain_back_until_it_expires_or_the_chain_grows_hotter():
    w = World(prefill=1e-6)  # the gate refuses
    c = chain(3, 1)
    hot_on_rank0(w, c)
    assert w.placement.tick() == [] and w.placement.refused == {"admission": 1}
    assert w.placement.tick() == [] and w.placement.refused == {"admission": 1, "cooldown": 1}
    w.route(c, 1)  # hotter, not twice as hot
    assert w.placement.tick() == [] and w.placement.refused["cooldown"] == 2
    w.route(c, 3)  # twice as hot as when refused: the gate is asked again at once
    assert w.placement.tick() == [] and w.placement.refused["admission"] == 2
    w.clock.now += 31.0
    w.route(c, 1)  # hot again, far below the heat it was refused at
    assert w.placement.tick() == [] and w.placement.refused["admission"] == 3, "expired"


def test_no_source_when_no_rank_holds_the_whole_chain():
    # A rank reporting a block without its parent: no rank holds all resident ancestors.
    # Deltas, not snapshots: a snapshot replaces the rank's entries, and with them the heat.
    def setup(w, c):
        for rank, event in ((1, BlockStored(c[2], c[1], 0, 7)), (0, BlockRemoved(c[2], 2, 7))):
            w.versions[rank] += 1
            assert w.gbm.apply_delta(rank, 1, KVDelta(w.versions[rank] - 1, w.versions[rank], [event]))
    assert refusal(setup) == {"no_source": 1}


def test_destination_absence_refuses_a_partner_that_holds_the_chain():
    assert refusal(lambda w, c: w.cache(1, c)) == {"destination_holds": 1}


def test_destination_absence_refuses_blocks_already_on_their_way():
    assert refusal(lambda w, c: w.gbm.mark_in_flight(1, c[0], 3, 1)) == {"destination_holds": 1}


def test_a_partner_is_needed():
    w = World(n=2, topology=Topology.from_pairs(2, []))  # two GPUs without NVLink
    hot_on_rank0(w, chain(3, 1))
    assert w.placement.tick() == [] and w.placement.refused == {"no_partner": 1}


def test_load_skew_refuses_when_the_source_is_not_busier():
    assert refusal(lambda w, c: w.load(1, waiting_prefill_tokens=950)) == {"load_skew": 1}


def test_pair_idleness_refuses_while_a_plan_runs_between_the_ranks():
    other = chain(1, 9)
    assert refusal(lambda w, c: w.coord.start(1, 0, other, [1], [ROOT_HASH])) == {"pair_busy": 1}


def test_target_capacity_refuses_a_copy_its_free_and_reclaimable_blocks_cannot_hold():
    assert refusal(lambda w, c: w.load(1, blocks_free=2)) == {"capacity": 1}


def test_target_capacity_counts_reclaimable_cached_blocks():
    w = World()
    c = chain(3, 1)
    hot_on_rank0(w, c)
    w.gbm.update_load(1, 1, LoadReport(blocks_free=1, blocks_reclaimable=2))  # evicting 2 cold blocks makes room
    (batch,) = w.placement.tick()
    assert batch.dst == 1 and len(batch.hashes) == 3


def test_capacity_counts_reservations_and_blocks_other_plans_bring():
    w = World(n=3)
    c = chain(3, 1)
    hot_on_rank0(w, c)
    w.load(2, waiting_prefill_tokens=1000)  # so the destination is rank 1
    w.load(1, blocks_free=6)
    w.gbm.reserve("r", 1, blocks=2, tokens=0)
    other = w.coord.start(2, 1, chain(2, 8), [1, 1], [ROOT_HASH, 8001])  # brings 2 blocks to rank 1
    assert w.placement.tick() == [] and w.placement.refused == {"capacity": 1}  # 6 - 2 - 2 < 3
    w.coord.abort(other.plan_id, "test")
    assert w.placement.tick() and w.placement.refused == {"capacity": 1}, "6 - 2 free blocks hold 3"


def test_the_admission_gate_refuses_little_saved_prefill():
    w = World(prefill=1e-6)  # 16 us of prefill per block against ~1 ms of transfer
    c = chain(3, 1)
    hot_on_rank0(w, c)
    assert w.placement.tick() == [] and w.placement.refused == {"admission": 1}
    decision = w.placement.decisions[0]
    assert not decision.admitted and decision.saved_prefill_s < decision.transfer_cost_s
    assert w.placement.tick() == [] and w.placement.refused["cooldown"] == 1, "a refusal cools down"


def test_gate_decisions_are_logged_with_both_figures(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lmpool.control.transfers.admission")
    w = World()
    hot_on_rank0(w, chain(3, 1))
    w.placement.tick()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("admit background transfer 0->1 of 3 blocks: saves 48.000 ms of prefill, costs")


# ---- caps and coalescing ---------------------------------------------------------------------


def test_chains_to_one_pair_coalesce_up_to_the_batch_cap_each_block_once():
    stem = chain(1, 1)
    chains = [stem + [2000 + 10 * k + i for i in range(3)] for k in range(3)]  # share their first block

    def hot_on_a_loaded_rank(max_blocks: int, batch_max: int) -> World:
        w = World(max_blocks=max_blocks, batch_max=batch_max)
        w.cache(0, *chains)
        w.load(0, waiting_prefill_tokens=1000)
        for c in chains:
            w.route(c, 2)
        w.load(0, waiting_prefill_tokens=1000)
        return w

    w = hot_on_a_loaded_rank(max_blocks=2, batch_max=5)
    (batch,) = w.placement.tick()
    # Each chain's copy is its first 2 blocks; the shared root once: 2 + 1 + 1 blocks.
    assert len(batch.hashes) == len(set(batch.hashes)) == 4
    assert batch.hashes[0] == stem[0] and batch.parents == [ROOT_HASH, stem[0], stem[0], stem[0]]
    assert w.placement.refused == {} and len(batch.leases) == 3
    # Whole chains (4 blocks each, so each cools down once placed): 4 + 3, then 3 more.
    w2 = hot_on_a_loaded_rank(max_blocks=4, batch_max=7)
    (batch,) = w2.placement.tick()
    assert len(batch.hashes) == 7 and w2.placement.refused == {"batch_full": 1}
    w2.cache(1, *[c for c in chains if (c[3], 4) in batch.leases])  # the first batch landed
    (rest,) = w2.placement.tick()
    assert rest.leases == [(chains[0][3], 4)], "a chain left out of a full batch is not cooled down"


def test_one_batch_per_directed_pair_and_not_both_directions_at_once():
    w = World(n=3, skew=1e-4)
    a, b = chain(2, 1), chain(2, 2)
    w.cache(0, a)
    w.cache(1, b)
    w.load(0, waiting_prefill_tokens=1000)
    w.load(1, waiting_prefill_tokens=500)
    w.route(a, 2)
    w.route(b, 2)
    w.load(0, waiting_prefill_tokens=1000)
    w.load(1, waiting_prefill_tokens=500)
    batches = w.placement.tick()
    # a goes to both partners (each less loaded than rank 0); b to rank 2 only, rank 0 being busier.
    assert sorted((x.src, x.dst) for x in batches) == [(0, 1), (0, 2), (1, 2)]


def test_a_hot_chain_is_copied_to_several_partners_in_one_tick():
    w = World(n=4)
    c = chain(3, 1)
    hot_on_rank0(w, c)
    batches = w.placement.tick()
    assert sorted(b.dst for b in batches) == [1, 2, 3] and all(b.hashes == c for b in batches)


# ---- a pass in slices ------------------------------------------------------------------------


def busy_world() -> tuple[World, list[list[int]]]:
    w = World(n=4)
    chains = [chain(3, f) for f in range(1, 5)]
    w.cache(0, *chains)
    w.load(0, waiting_prefill_tokens=1000)
    for c in chains:
        w.route(c, 2)
    w.load(0, waiting_prefill_tokens=1000)
    return w, chains


def test_a_pass_in_slices_gives_the_copies_a_whole_pass_gives():
    whole, _ = busy_world()
    sliced, chains = busy_world()
    placement_pass = sliced.placement.start_pass()
    slices = 1
    while not placement_pass.run(0.0):  # a zero budget: one step per slice
        slices += 1
    # Each chain: three steps, each trying one of its 3 partners, and one that closes it; then
    # the call that finds no chain left.
    assert slices == len(chains) * 4 + 1
    expected = [(b.src, b.dst, b.hashes, b.leases) for b in whole.placement.tick()]
    assert [(b.src, b.dst, b.hashes, b.leases) for b in placement_pass.copies()] == expected
    assert sliced.placement.refused == whole.placement.refused


def test_a_reaction_looks_only_at_the_chains_routed_since_the_last_pass():
    w, chains = busy_world()
    assert w.placement.chains.newest_first(fresh_only=True) == chains[::-1]
    assert w.placement.chains.newest_first(fresh_only=True) == [], "a pass leaves none fresh"
    w.route(chains[1], 1)
    placement_pass = w.placement.start_pass(fresh_only=True)
    while not placement_pass.run(None):
        pass
    assert {tuple(b.hashes) for b in placement_pass.copies()} == {tuple(chains[1])}
    assert len(w.placement.chains) == len(chains), "the others are still remembered for a full pass"


def test_a_batch_whose_pair_turned_busy_between_slices_is_not_started():
    w, chains = busy_world()
    placement_pass = w.placement.start_pass()
    assert not placement_pass.run(0.0)
    w.coord.start(1, 0, [chains[0][0]], [7], [ROOT_HASH])  # a plan opens on the pair (0, 1) meanwhile
    while not placement_pass.run(0.0):
        pass
    assert sorted(b.dst for b in placement_pass.copies()) == [2, 3]
    assert w.placement.refused["pair_busy"] == 1


def test_a_source_that_lost_the_chain_between_slices_is_refused_not_sent_unknown_generations():
    w, chains = busy_world()
    placement_pass = w.placement.start_pass()
    assert not placement_pass.run(0.0)  # the newest chain's source chosen, its first partner tried
    w.cache(0, *chains[:-1])  # rank 0 reports the newest chain gone before the next slice
    while not placement_pass.run(0.0):
        pass
    copies = placement_pass.copies()
    assert all(isinstance(g, int) for b in copies for g in b.generations)
    assert [b.dst for b in copies if chains[-1][0] in b.hashes] == [1], "only the copy chosen before"


# ---- invariants under random demand -----------------------------------------------------------


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World(n=3, max_blocks=2, batch_max=5, skew=5e-4)
        self.families = {f: chain(4, f) for f in range(1, 6)}
        self.open_pass = None  # a pass run slice by slice (``pass_slice``)

    @rule(rank=st.integers(0, 2), fams=st.lists(st.integers(1, 5), min_size=1, max_size=3), depth=st.integers(1, 4))
    def cache(self, rank, fams, depth):
        self.w.cache(rank, *[self.families[f][:depth] for f in fams])

    @rule(rank=st.integers(0, 2), work=st.integers(0, 2000), free=st.integers(0, 20))
    def load(self, rank, work, free):
        self.w.load(rank, waiting_prefill_tokens=work, blocks_free=free)

    @rule(fam=st.integers(1, 5), depth=st.integers(1, 4), times=st.integers(1, 3))
    def route(self, fam, depth, times):
        self.w.route(self.families[fam][:depth], times)

    @rule(dt=st.floats(0, 40))
    def time_passes(self, dt):
        self.w.clock.now += dt

    @rule()
    def end_plans(self):
        for plan_id in list(self.w.coord.plans):
            self.w.coord.abort(plan_id, "test")

    @rule()
    def tick(self):
        w = self.w
        if self.open_pass is not None:
            return  # one pass at a time, as the control plane runs them
        busy = {frozenset((p.src, p.dst)) for p in w.coord.plans.values()}
        batches = w.placement.tick()
        pairs = [frozenset((b.src, b.dst)) for b in batches]
        assert len(pairs) == len(set(pairs)), "one batch per pair per tick, in one direction"
        for b in batches:
            assert frozenset((b.src, b.dst)) not in busy, "never on a pair with an open plan"
            assert 0 < len(b.hashes) <= 5 and len(set(b.hashes)) == len(b.hashes)
            known = {ROOT_HASH}
            for h, parent in zip(b.hashes, b.parents):
                assert parent in known or w.gbm.ready_ranks(parent) >> b.dst & 1, "parents before children"
                known.add(h)
            for h, g in zip(b.hashes, b.generations):
                assert w.gbm.ready_ranks(h) >> b.src & 1 and g == 7, "the source holds what it sends"
                assert not w.gbm.ready_ranks(h) >> b.dst & 1, "destination absence"
            w.coord.start(b.src, b.dst, b.hashes, b.generations, b.parents)

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2), fam=st.integers(1, 5))
    def other_plan(self, src, dst, fam):
        """A plan some other policy opens (a pull, a release): between slices, too."""
        if src != dst:
            self.w.coord.start(src, dst, [self.families[fam][0]], [7], [ROOT_HASH])

    @rule()
    def pass_slice(self):
        """One chain of a pass; at its end, what it starts passes the gates as they are then."""
        w = self.w
        if self.open_pass is None:
            self.open_pass = w.placement.start_pass()
        if not self.open_pass.run(0.0):
            return
        batches, self.open_pass = self.open_pass.copies(), None
        pairs = [frozenset((b.src, b.dst)) for b in batches]
        assert len(pairs) == len(set(pairs)), "one batch per pair per pass, in one direction"
        taken = {}
        for b in batches:
            assert not w.coord.busy(b.src, b.dst), "never on a pair with an open plan at the pass's end"
            assert w.gbm.alive_mask >> b.src & 1 and w.gbm.alive_mask >> b.dst & 1
            assert 0 < len(b.hashes) <= 5 and len(set(b.hashes)) == len(b.hashes)
            taken[b.dst] = taken.get(b.dst, 0) + len(b.hashes)
        assert all(n <= w.coord.room(dst) for dst, n in taken.items()), "the copies fit their destinations"
        for b in batches:
            w.coord.start(b.src, b.dst, b.hashes, b.generations, b.parents)

    @invariant()
    def page_table(self):
        self.w.gbm.check_invariants()


TestPlacementMachine = PlacementMachine.TestCase
TestPlacementMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
