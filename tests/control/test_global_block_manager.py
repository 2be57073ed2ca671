"""GlobalBlockManager: versioned snapshots and deltas, stale and gapped updates, dead and restarted
ranks, in-flight (unpublished) blocks, reservations and demand stats; a stateful property test
against a plain model; and a mirror of a real worker BlockManager."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmpool.control.page_table.manager import GlobalBlockManager, PageEntry, StaleUpdateError
from lmpool.engine.block_manager import BlockManager
from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVSnapshot
from lmpool.engine.sequence import Sequence
from lmpool.protocol import LoadReport
from lmpool.sampling_params import SamplingParams
from control_testkit import ManualClock, chain_blocks

BLOCK = 4


def make(world: int = 3, clock: ManualClock | None = None) -> GlobalBlockManager:
    gbm = GlobalBlockManager(world, BLOCK, reservation_ttl_s=5.0, clock=clock or ManualClock(100.0))
    for rank in range(world):
        gbm.register_rank(rank, epoch=1, num_blocks=64)
    return gbm


def test_snapshot_then_deltas():
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(3, chain_blocks([11, 12, 13])))
    assert gbm.prefix_match([11, 12, 13, 14]) == [3, 0, 0]
    assert gbm.entries(12) == [PageEntry(rank=0, block_id=1, generation=1, ready=True)]

    delta = KVDelta(3, 5, [BlockStored(14, 13, 7, 2), BlockRemoved(11, 0, 1)])
    assert gbm.apply_delta(0, 1, delta)
    assert gbm.ranks[0].version == 5
    # Block 11 left, so rank 0's chain no longer starts at the first block.
    assert gbm.prefix_match([11, 12, 13, 14]) == [0, 0, 0]
    assert gbm.prefix_match([12]) == [1, 0, 0]
    assert gbm.entries(14) == [PageEntry(0, 7, 2, True)]
    assert gbm.deltas_applied == 1 and gbm.snapshots_applied == 1
    gbm.check_invariants()


def test_prefix_match_counts_only_the_contiguous_chain_per_rank():
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(4, chain_blocks([1, 2, 3, 4])))
    gbm.apply_snapshot(1, 1, KVSnapshot(3, chain_blocks([1, 2]) + [BlockStored(4, 3, 9, 1)]))  # hole at 3
    gbm.apply_snapshot(2, 1, KVSnapshot(1, [BlockStored(2, 1, 0, 1)]))  # no first block
    assert gbm.prefix_match([1, 2, 3, 4]) == [4, 2, 0]
    assert gbm.prefix_match([1, 2, 3, 4], candidates=0b110) == [0, 2, 0]
    assert gbm.prefix_match([]) == [0, 0, 0]
    assert gbm.prefix_match([99, 1]) == [0, 0, 0]


def test_stale_epochs_and_versions_are_rejected_and_counted():
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(5, chain_blocks([1, 2])))
    with pytest.raises(StaleUpdateError, match="older than the applied 5"):
        gbm.apply_snapshot(0, 1, KVSnapshot(4, chain_blocks([7])))
    with pytest.raises(StaleUpdateError, match="epoch 0 is stale"):
        gbm.apply_snapshot(0, 0, KVSnapshot(9, chain_blocks([7])))
    with pytest.raises(StaleUpdateError):
        gbm.apply_delta(0, 0, KVDelta(5, 6, [BlockStored(3, 2, 5, 1)]))
    with pytest.raises(StaleUpdateError):
        gbm.update_load(0, 0, LoadReport(blocks_free=1))
    with pytest.raises(StaleUpdateError):
        gbm.register_rank(0, 0, 64)
    assert gbm.stale_rejected == 5
    # Nothing stale was applied.
    assert gbm.prefix_match([1, 2]) == [2, 0, 0] and gbm.prefix_match([7]) == [0, 0, 0]
    assert gbm.ranks[0].version == 5 and gbm.ranks[0].load.blocks_free == 64
    # The same version again is a plain resend: accepted.
    gbm.apply_snapshot(0, 1, KVSnapshot(5, chain_blocks([1])))
    assert gbm.prefix_match([1, 2]) == [1, 0, 0]
    gbm.check_invariants()


def test_delta_gap_returns_false_then_a_snapshot_resyncs():
    gbm = make()
    gbm.apply_snapshot(1, 1, KVSnapshot(2, chain_blocks([1, 2])))
    assert not gbm.apply_delta(1, 1, KVDelta(3, 4, [BlockStored(3, 2, 2, 1)]))  # version 2 -> 3 is missing
    assert gbm.gaps == 1
    assert gbm.prefix_match([1, 2, 3]) == [0, 2, 0], "a gapped delta changes nothing"
    assert gbm.ranks[1].version == 2
    gbm.apply_snapshot(1, 1, KVSnapshot(4, chain_blocks([1, 2, 3])))
    assert gbm.apply_delta(1, 1, KVDelta(4, 5, [BlockStored(4, 3, 3, 1)]))
    assert gbm.prefix_match([1, 2, 3, 4]) == [0, 4, 0]
    gbm.check_invariants()


def test_delta_before_any_snapshot_is_a_gap_and_a_malformed_delta_is_an_error():
    gbm = make()
    assert not gbm.apply_delta(0, 1, KVDelta(0, 1, [BlockStored(1, 0, 0, 1)]))
    assert gbm.prefix_match([1]) == [0, 0, 0]
    gbm.apply_snapshot(0, 1, KVSnapshot(0, []))
    with pytest.raises(ValueError, match="carries 1 events"):
        gbm.apply_delta(0, 1, KVDelta(0, 2, [BlockStored(1, 0, 0, 1)]))
    with pytest.raises(ValueError, match="before it was registered"):
        GlobalBlockManager(2, BLOCK).apply_snapshot(1, 0, KVSnapshot(0, []))
    with pytest.raises(ValueError, match="out of range"):
        gbm.register_rank(3, 0, 8)


def test_removal_of_another_generation_is_ignored():
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(1, [BlockStored(5, 0, 3, 2)]))
    assert gbm.apply_delta(0, 1, KVDelta(1, 2, [BlockRemoved(5, 3, 1)]))  # generation 1: an older copy
    assert gbm.entries(5) == [PageEntry(0, 3, 2, True)]


def test_mark_dead_drops_entries_and_reservations_until_a_newer_epoch():
    clock = ManualClock(100.0)
    gbm = make(clock=clock)
    for rank in (0, 1):
        gbm.apply_snapshot(rank, 1, KVSnapshot(2, chain_blocks([1, 2])))
    gbm.reserve("a", 0, blocks=4, tokens=100)
    gbm.mark_dead(0)
    assert gbm.prefix_match([1, 2]) == [0, 2, 0]
    assert gbm.entries(1) == [PageEntry(1, 0, 1, True)]
    assert "a" not in gbm.reservations and gbm.ranks[0].reserved_blocks == 0
    assert gbm.alive_mask == 0b110
    assert not gbm.rank_state(0).alive
    gbm.check_invariants()
    # Late reports of the dead incarnation are stale; it cannot come back under the same epoch.
    with pytest.raises(StaleUpdateError, match="dead"):
        gbm.apply_snapshot(0, 1, KVSnapshot(3, chain_blocks([1, 2])))
    with pytest.raises(StaleUpdateError):
        gbm.rank_up(0, 1)
    with pytest.raises(ValueError, match="not alive"):
        gbm.reserve("b", 0, 1, 1)
    # A restart: new epoch, no entries until its snapshot; a delta before it is a gap.
    gbm.rank_up(0, 2)
    assert gbm.alive_mask == 0b111 and gbm.ranks[0].version is None
    assert not gbm.apply_delta(0, 2, KVDelta(0, 1, [BlockStored(1, 0, 0, 1)]))
    gbm.apply_snapshot(0, 2, KVSnapshot(1, chain_blocks([1])))
    assert gbm.prefix_match([1, 2]) == [1, 2, 0]
    gbm.check_invariants()


def test_a_report_at_a_newer_epoch_restarts_the_rank():
    gbm = make()
    gbm.apply_snapshot(2, 1, KVSnapshot(7, chain_blocks([1, 2, 3])))
    gbm.reserve("a", 2, 1, 1)
    gbm.apply_snapshot(2, 2, KVSnapshot(1, chain_blocks([1])))  # version 1 < 7, but a new incarnation
    assert gbm.ranks[2].epoch == 2 and gbm.ranks[2].version == 1
    assert gbm.prefix_match([1, 2, 3]) == [0, 0, 1]
    assert "a" not in gbm.reservations
    gbm.register_rank(2, 2, 64)  # the same incarnation announcing itself again keeps its state
    assert gbm.prefix_match([1, 2, 3]) == [0, 0, 1]
    gbm.check_invariants()


def test_mark_dead_on_a_rank_that_never_registered():
    gbm = GlobalBlockManager(2, BLOCK)
    gbm.mark_dead(1)
    gbm.register_rank(1, 0, 8)
    assert gbm.alive_mask == 0b10
    gbm.check_invariants()


def test_in_flight_blocks_are_invisible_to_routing_until_published():
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(2, chain_blocks([1, 2])))
    gbm.apply_snapshot(1, 1, KVSnapshot(1, chain_blocks([1])))
    # A transfer reserves block 40 on rank 1 for hash 2, then the data lands and the worker reports it.
    assert gbm.mark_in_flight(1, 2, block_id=40, generation=3)
    assert gbm.entries(2) == [PageEntry(0, 1, 1, True), PageEntry(1, 40, 3, False)]
    assert gbm.prefix_match([1, 2]) == [2, 1, 0]
    assert gbm.apply_delta(1, 1, KVDelta(1, 2, [BlockStored(2, 1, 40, 3)]))
    assert gbm.prefix_match([1, 2]) == [2, 1, 0], "received but unpublished"
    gbm.check_invariants()
    gbm.unmark_in_flight(1, 2, published=True)
    assert gbm.prefix_match([1, 2]) == [2, 2, 0]
    gbm.check_invariants()
    # Marking a hash the rank already serves is refused: that transfer would be redundant.
    assert not gbm.mark_in_flight(0, 1, block_id=9, generation=1)


def test_route_check_refuses_a_decision_counting_reserved_or_absent_blocks():
    """The invariant hook the pool's control plane runs on every routing decision in tests."""
    gbm = make()
    gbm.apply_snapshot(0, 1, KVSnapshot(2, chain_blocks([1, 2])))
    gbm.apply_snapshot(1, 1, KVSnapshot(1, chain_blocks([1])))
    gbm.mark_in_flight(1, 2, block_id=40, generation=3)
    lengths = gbm.prefix_match([1, 2, 3])
    for rank, matched in enumerate(lengths):
        gbm.check_route([1, 2, 3], rank, matched)  # what routing counts always passes
    with pytest.raises(AssertionError, match="reserved for an unpublished transfer"):
        gbm.check_route([1, 2, 3], 1, 2)
    with pytest.raises(AssertionError, match="does not hold"):
        gbm.check_route([1, 2, 3], 0, 3)


def test_aborted_transfer_drops_its_reserved_block_but_keeps_a_worker_copy():
    gbm = make()
    gbm.apply_snapshot(1, 1, KVSnapshot(0, []))
    gbm.mark_in_flight(1, 5, block_id=3, generation=1)
    gbm.unmark_in_flight(1, 5, published=False)
    assert gbm.entries(5) == []
    gbm.mark_in_flight(1, 6, block_id=4, generation=1)
    # Meanwhile the worker computed the same block itself, in another block.
    assert gbm.apply_delta(1, 1, KVDelta(0, 1, [BlockStored(6, 0, 8, 2)]))
    gbm.unmark_in_flight(1, 6, published=False)
    assert gbm.entries(6) == [PageEntry(1, 8, 2, True)]
    assert gbm.prefix_match([6]) == [0, 1, 0]
    gbm.check_invariants()


def test_reservations_released_by_admission_explicitly_and_by_ttl():
    clock = ManualClock(100.0)
    gbm = make(clock=clock)
    gbm.reserve("a", 0, blocks=3, tokens=30)
    gbm.reserve("b", 0, blocks=2, tokens=20)
    gbm.reserve("c", 1, blocks=1, tokens=10)
    assert gbm.ranks[0].blocks_available == 64 - 5
    # A report admits "a"; "c" is listed by the wrong rank and stays.
    gbm.update_load(0, 1, LoadReport(blocks_free=60, admitted=["a", "c"]))
    assert set(gbm.reservations) == {"b", "c"}
    assert (gbm.ranks[0].reserved_blocks, gbm.ranks[0].reserved_tokens) == (2, 20)
    assert gbm.release("c") and not gbm.release("c")
    # Re-routing a request moves its reservation instead of adding one.
    clock.now += 3
    gbm.reserve("b", 2, blocks=2, tokens=20)
    assert gbm.ranks[0].reserved_blocks == 0 and gbm.ranks[2].reserved_blocks == 2
    gbm.reserve("d", 1, blocks=1, tokens=1)
    clock.now += 2.5  # "b" was re-reserved 2.5 s ago: only its first, superseded reservation is past the TTL
    assert gbm.expire_reservations() == 0
    clock.now += 3
    assert gbm.expire_reservations() == 2
    assert gbm.reservations == {}
    assert all(info.reserved_blocks == info.reserved_tokens == info.num_reservations == 0 for info in gbm.ranks)
    gbm.check_invariants()
    with pytest.raises(ValueError, match=">= 0"):
        gbm.reserve("e", 0, blocks=-1, tokens=0)


def test_reservations_count_their_heads_until_released():
    """A rank's ``heads``: its reservations of each group key, the head gone at 0; a
    re-routed request's head moves with it; the invariant check catches a count off by one."""
    gbm = make()
    gbm.reserve("a", 0, 1, 1, head=b"doc")
    gbm.reserve("b", 0, 1, 1, head=b"doc", deferred=True, cascade=32, converted=32)  # joined "a", alone till then
    gbm.reserve("c", 0, 1, 1, head=b"other")
    gbm.reserve("d", 0, 1, 1)  # a prompt that shares no prefix heads no group
    gbm.reserve("e", 1, 1, 1, head=b"doc")
    assert gbm.ranks[0].reserved.heads == {b"doc": 2, b"other": 1} and gbm.ranks[1].reserved.heads == {b"doc": 1}
    gbm.admissible("b")  # no longer deferred, still of its head
    gbm.update_load(0, 1, LoadReport(blocks_free=60, admitted=["a", "c"]))
    gbm.reserve("e", 0, 1, 1, head=b"doc")  # re-routed: its head leaves rank 1
    assert gbm.ranks[0].reserved.heads == {b"doc": 2} and gbm.ranks[1].reserved.heads == {}
    assert gbm.ranks[0].reserved.converted == 32  # "b"'s, until it is admitted
    gbm.check_invariants()
    with pytest.raises(ValueError, match="converted"):
        gbm.reserve("f", 0, 1, 1, converted=-1)
    gbm.ranks[0].reserved.heads[b"doc"] = 3
    with pytest.raises(AssertionError, match="heads"):
        gbm.check_invariants()


def test_demand_stats_follow_routes_and_vanish_with_the_last_copy():
    clock = ManualClock(100.0)
    gbm = make(clock=clock)
    gbm.apply_snapshot(0, 1, KVSnapshot(3, chain_blocks([1, 2, 3])))
    gbm.record_route([1, 2, 3, 4], held=3, used=2)
    clock.now = 150.0
    gbm.record_route([1, 2, 3, 4], held=3, used=0)
    s = gbm.hash_stats(2)
    assert (s.accesses, s.route_hits, s.last_access) == (2, 1, 150.0)
    assert gbm.hash_stats(3).route_hits == 0 and gbm.hash_stats(4) is None
    gbm.check_invariants()
    gbm.mark_dead(0)
    assert gbm.hash_stats(2) is None
    gbm.check_invariants()


def test_rank_state_reports_heartbeat_age_and_cached_blocks():
    clock = ManualClock(100.0)
    gbm = make(clock=clock)
    gbm.apply_snapshot(1, 1, KVSnapshot(4, chain_blocks([1, 2])))
    clock.now += 2.5
    state = gbm.rank_state(1)
    assert (state.alive, state.epoch, state.snapshot_version, state.cached_blocks) == (True, 1, 4, 2)
    assert state.heartbeat_age_s == pytest.approx(2.5)
    gbm.update_load(1, 1, LoadReport(num_running=3))
    assert gbm.rank_state(1).heartbeat_age_s == 0 and gbm.rank_state(1).load.num_running == 3
    assert gbm.rank_state(2).snapshot_version == -1


def test_mirrors_a_worker_block_manager_through_its_deltas():
    """The page table built from a real BlockManager's deltas matches its prefix cache."""
    bm = BlockManager(num_blocks=12, block_size=BLOCK)
    gbm = GlobalBlockManager(1, BLOCK)
    gbm.register_rank(0, 0, 12)
    gbm.apply_snapshot(0, 0, bm.snapshot())
    params = SamplingParams(temperature=0, max_tokens=1)
    prompts = [list(range(10)), list(range(8)) + [50, 51, 52], [7] * 14, list(range(12)), [9] * 21]
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"s{i}", prompt, params, BLOCK)
        hit = bm.match_prefix(seq)
        need = bm.blocks_needed(len(prompt)) - len(hit)
        assert bm.can_admit(hit, need)
        bm.admit(seq, hit)
        bm.grow(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        bm.commit(seq)
        bm.free(seq)
        assert gbm.apply_delta(0, 0, bm.drain_delta())
        mirrored = {h: (e.block_id, e.generation) for h in bm.hash_to_block for e in gbm.entries(h)}
        assert mirrored == {h: (b, bm.blocks[b].generation) for h, b in bm.hash_to_block.items()}
        assert gbm.ranks[0].num_ready == len(bm.hash_to_block)
        gbm.check_invariants()
    assert gbm.prefix_match(Sequence("x", list(range(12)), params, BLOCK).block_hashes) == [3]


# ---- stateful property test ---------------------------------------------------------

WORLD = 3
# A small forest of chains, so prefixes are shared and contiguity matters.
CHAINS = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9], [1, 10]]
HASHES = sorted({h for c in CHAINS for h in c})


class ModelRank:
    def __init__(self) -> None:
        self.registered = False
        self.alive = False
        self.epoch = -1
        self.version: int | None = None
        self.entries: dict[int, tuple[int, int]] = {}  # hash -> (block_id, generation)
        self.in_flight: dict[int, tuple[int, int]] = {}

    def ready(self, h: int) -> bool:
        return self.alive and h in self.entries and h not in self.in_flight


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(100.0)
        self.gbm = GlobalBlockManager(WORLD, BLOCK, reservation_ttl_s=5.0, clock=self.clock)
        self.model = [ModelRank() for _ in range(WORLD)]
        self.reservations: dict[str, tuple[int, float]] = {}  # request id -> (rank, created)
        self.deferred: set[str] = set()  # request ids whose reservation waits on a pull
        self.n = 0

    @initialize(registered=st.sets(st.integers(0, WORLD - 1)))
    def start(self, registered: set[int]) -> None:
        """Most runs start with live ranks that sent their first (empty) snapshot, as after launch."""
        for rank in sorted(registered):
            self.gbm.register_rank(rank, 0, 32)
            self.gbm.apply_snapshot(rank, 0, KVSnapshot(0, []))
            self._restart(rank, 0)
            self.model[rank].version = 0

    def _expire(self) -> None:
        deadline = self.clock.now - self.gbm.reservation_ttl_s
        self.reservations = {k: v for k, v in self.reservations.items() if v[1] > deadline}

    def _drop_reservations(self, rank: int) -> None:
        self.reservations = {k: v for k, v in self.reservations.items() if v[0] != rank}

    def _accepts(self, m: ModelRank, epoch: int) -> bool:
        return not m.registered or epoch > m.epoch or (epoch == m.epoch and m.alive)

    def _restart(self, rank: int, epoch: int) -> None:
        m = self.model[rank]
        m.registered, m.alive, m.epoch, m.version = True, True, epoch, None
        m.entries, m.in_flight = {}, {}
        self._drop_reservations(rank)

    @rule(rank=st.integers(0, WORLD - 1), bump=st.integers(-1, 1))
    def register(self, rank: int, bump: int) -> None:
        m = self.model[rank]
        epoch = max(0, m.epoch + bump)
        if not self._accepts(m, epoch):
            with pytest.raises(StaleUpdateError):
                self.gbm.register_rank(rank, epoch, 32)
            return
        self.gbm.register_rank(rank, epoch, 32)
        if not m.registered or epoch > m.epoch:
            self._restart(rank, epoch)

    @rule(rank=st.integers(0, WORLD - 1), epoch_bump=st.integers(-1, 1), version_bump=st.integers(-2, 3),
          hashes=st.sets(st.sampled_from(HASHES)), generation=st.integers(1, 3))
    def snapshot(self, rank, epoch_bump, version_bump, hashes, generation) -> None:
        m = self.model[rank]
        if not m.registered:
            return
        epoch = m.epoch + epoch_bump
        if epoch < 0:
            return
        version = max(0, (m.version or 0) + version_bump)
        blocks = [BlockStored(h, 0, h + 100, generation) for h in sorted(hashes)]
        stale = not self._accepts(m, epoch) or (
            epoch == m.epoch and m.version is not None and version < m.version
        )
        if stale:
            with pytest.raises(StaleUpdateError):
                self.gbm.apply_snapshot(rank, epoch, KVSnapshot(version, blocks))
            return
        self.gbm.apply_snapshot(rank, epoch, KVSnapshot(version, blocks))
        if epoch > m.epoch:
            self._restart(rank, epoch)
        m.entries = {b.block_hash: (b.block_id, b.generation) for b in blocks}
        m.version = version

    @rule(rank=st.integers(0, WORLD - 1), gap=st.sampled_from([0, 0, 0, 1]), data=st.data())
    def delta(self, rank, gap, data) -> None:
        m = self.model[rank]
        if not m.registered or not m.alive:
            return
        events = []
        for _ in range(data.draw(st.integers(0, 4))):
            # Favour hashes a transfer is bringing here: the worker may cache its own copy meanwhile.
            h = data.draw(st.sampled_from(HASHES + sorted(m.in_flight) * 4))
            if data.draw(st.booleans()) and h in m.entries:
                block_id, generation = m.entries[h]
                generation += data.draw(st.sampled_from([0, 0, 1]))  # sometimes an older copy's removal
                events.append(BlockRemoved(h, block_id, generation))
            else:
                events.append(BlockStored(h, 0, data.draw(st.integers(0, 9)), data.draw(st.integers(1, 3))))
        start = (m.version or 0) + gap
        applied = self.gbm.apply_delta(rank, m.epoch, KVDelta(start, start + len(events), events))
        assert applied == (m.version is not None and gap == 0)
        if not applied:
            return
        for ev in events:
            if isinstance(ev, BlockStored):
                m.entries[ev.block_hash] = (ev.block_id, ev.generation)
            elif m.entries.get(ev.block_hash) == (ev.block_id, ev.generation):
                del m.entries[ev.block_hash]
        m.version = start + len(events)

    @rule(rank=st.integers(0, WORLD - 1))
    def mark_dead(self, rank: int) -> None:
        self.gbm.mark_dead(rank)
        m = self.model[rank]
        m.alive, m.version, m.entries, m.in_flight = False, None, {}, {}
        self._drop_reservations(rank)

    @rule(rank=st.integers(0, WORLD - 1), bump=st.integers(0, 1))
    def rank_up(self, rank: int, bump: int) -> None:
        m = self.model[rank]
        epoch = max(0, m.epoch + bump)
        if not self._accepts(m, epoch):
            with pytest.raises(StaleUpdateError):
                self.gbm.rank_up(rank, epoch)
            return
        self.gbm.rank_up(rank, epoch)
        if not m.registered or epoch > m.epoch:
            self._restart(rank, epoch)

    @rule(rank=st.integers(0, WORLD - 1), h=st.sampled_from(HASHES), block_id=st.integers(20, 29))
    def mark_in_flight(self, rank: int, h: int, block_id: int) -> None:
        m = self.model[rank]
        if not m.alive:
            return
        marked = self.gbm.mark_in_flight(rank, h, block_id, 1)
        assert marked == (not m.ready(h))
        if marked:
            m.in_flight[h] = (block_id, 1)
            m.entries.setdefault(h, (block_id, 1))

    @rule(data=st.data(), published=st.booleans())
    def unmark_in_flight(self, data, published: bool) -> None:
        marked = [(r, h) for r, m in enumerate(self.model) for h in sorted(m.in_flight)]
        rank, h = data.draw(st.sampled_from(marked or [(r, h) for r in range(WORLD) for h in HASHES]))
        m = self.model[rank]
        self.gbm.unmark_in_flight(rank, h, published)
        reserved = m.in_flight.pop(h, None)
        if reserved is not None and not published and m.entries.get(h) == reserved:
            del m.entries[h]

    @rule(rank=st.integers(0, WORLD - 1), blocks=st.integers(0, 4), deferred=st.booleans(),
          head=st.sampled_from([None, b"doc", b"other"]))
    def reserve(self, rank: int, blocks: int, deferred: bool, head: bytes | None) -> None:
        if not self.model[rank].alive:
            return
        self.n += 1
        self.gbm.reserve(f"q{self.n}", rank, blocks, blocks * BLOCK, blocks, deferred=deferred, head=head)
        self.reservations[f"q{self.n}"] = (rank, self.clock.now)
        if deferred:
            self.deferred.add(f"q{self.n}")

    @rule(data=st.data())
    def pull_ends(self, data) -> None:
        """The pull a deferred reservation's request waited on ends: its work is admissible."""
        request_id = data.draw(st.sampled_from(sorted(self.deferred | {"unknown"})))
        self.gbm.admissible(request_id)
        self.deferred.discard(request_id)

    @rule(rank=st.integers(0, WORLD - 1), data=st.data())
    def admit(self, rank: int, data) -> None:
        m = self.model[rank]
        if not m.alive:
            return
        mine = sorted(k for k, (r, _) in self.reservations.items() if r == rank)
        admitted = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        self.gbm.update_load(rank, m.epoch, LoadReport(blocks_free=32, admitted=admitted))
        for k in admitted:
            del self.reservations[k]
        self._expire()

    @rule(seconds=st.sampled_from([1.0, 6.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.gbm.expire_reservations()
        self._expire()

    @precondition(lambda self: any(m.alive for m in self.model))
    @rule(chain=st.sampled_from(CHAINS))
    def route_demand(self, chain: list[int]) -> None:
        lengths = self.gbm.prefix_match(chain)
        self.gbm.record_route(chain, max(lengths), min(lengths))

    @invariant()
    def agrees_with_model(self) -> None:
        self.gbm.check_invariants()
        for rank, m in enumerate(self.model):
            info = self.gbm.ranks[rank]
            assert (info.alive, info.epoch, info.version) == (m.alive, m.epoch, m.version)
            got = {h: (e.block_id, e.generation) for h in HASHES for e in self.gbm.entries(h) if e.rank == rank}
            assert got == m.entries
        for chain in CHAINS:
            expected = []
            for m in self.model:
                n = 0
                while n < len(chain) and m.ready(chain[n]):
                    n += 1
                expected.append(n)
            assert self.gbm.prefix_match(chain) == expected
        assert set(self.gbm.reservations) == set(self.reservations)
        self.deferred &= set(self.reservations)  # released, admitted or expired: no longer deferred anywhere
        assert {k for k, r in self.gbm.reservations.items() if r.deferred} == self.deferred
        for rank in range(WORLD):  # a deferred reservation's tokens (blocks * BLOCK) and pairs (blocks)
            totals = self.gbm.ranks[rank].reserved
            mine = [self.gbm.reservations[k] for k in self.deferred if self.gbm.reservations[k].rank == rank]
            assert (totals.deferred_tokens, totals.deferred_attention) == (
                sum(r.tokens for r in mine), sum(r.attention for r in mine))
            heads = Counter(r.head for r in self.gbm.reservations.values() if r.rank == rank and r.head is not None)
            assert totals.heads == heads

    @invariant()
    def ready_index_and_rank_totals_agree_with_model(self) -> None:
        for h in HASHES:
            expected = sum(1 << rank for rank, m in enumerate(self.model) if m.ready(h))
            assert self.gbm.ready_ranks(h) == expected
        for rank, m in enumerate(self.model):
            info = self.gbm.ranks[rank]
            assert info.num_ready == sum(1 for h in m.entries if m.ready(h))
            assert info.num_reservations == sum(1 for r, _ in self.reservations.values() if r == rank)
            assert self.gbm.alive_mask >> rank & 1 == m.alive


TestPageTableMachine = PageTableMachine.TestCase
TestPageTableMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
