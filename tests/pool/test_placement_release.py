"""The worker's side of foreground release, without processes: hypothesis state machines for
the victims (``BlockManager.eviction_order`` names exactly what reclamation would take, never
a live block) and for the release hook (admission waits only while a move is pending and
before its deadline, and evicts right after a refusal), plus the scheduler asking the hook."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmpool.engine.block_manager import BlockManager, BlockState
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import BlockRemoved
from lmpool.engine.scheduler import Scheduler
from lmpool.engine.sequence import Sequence
from lmpool.protocol import ReleaseOutcome
from lmpool.worker.release import ForegroundRelease
from lmpool.sampling_params import SamplingParams
from block_testkit import prefill

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=1)
STEMS = [[1] * 8, [1] * 4 + [2] * 8, [3, 1, 4, 1, 5, 9, 2, 6], [7] * 12]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReleaseMachine(RuleBasedStateMachine):
    """Sequences come and go on one BlockManager; the release hook is asked about shortages,
    outcomes arrive (or not), time passes."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(14, BLOCK)
        self.clock = Clock()
        self.release = ForegroundRelease(self.bm, rank=0, epoch=1, wait_s=1.0, retry_s=2.0, clock=self.clock)
        self.live: list[Sequence] = []
        self.n = 0
        self.answered_refusal = False

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 2), max_size=6), keep=st.booleans())
    def sequence(self, stem, tail, keep):
        self.n += 1
        seq = prefill(self.bm, stem + tail, f"s{self.n}")
        if seq is not None and keep:
            self.live.append(seq)
        elif seq is not None:
            self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        self.bm.free(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))))

    @rule(n=st.integers(1, 6), exclude_live=st.booleans())
    def victims_are_what_reclamation_takes(self, n, exclude_live):
        exclude = [b for b in self.bm.hash_to_block.values() if self.bm.blocks[b].state is BlockState.RECLAIMABLE][:2]
        if not exclude_live:
            exclude = []
        victims = self.bm.eviction_order(n, exclude=exclude)
        for b in victims:
            assert self.bm.blocks[b].state is BlockState.RECLAIMABLE and self.bm.blocks[b].ref_count == 0
            assert b not in exclude
        if exclude:
            return
        # Reclaiming for real, on a copy, takes the same blocks in the same order.
        bm = copy.deepcopy(self.bm)
        bm.drain_delta()
        take = min(len(victims), bm.num_available)
        bm.allocate_blocks(bm.num_free + take)
        removed = [e.block_id for e in bm.drain_delta().events if isinstance(e, BlockRemoved)]
        assert removed == victims[:take]
        event(f"reclaimed {take} victims")

    @rule(n=st.integers(1, 4))
    def shortage(self, n):
        r = self.release
        pending_before, retry_before, evict_next_before = r.pending, r.retry_at, r.evict_next
        sent_before = len(r.outbox)
        waits = r.on_shortage([], n)
        now = self.clock.now
        if pending_before is not None:
            assert waits == (now < r.deadline), "waits while pending, and only until the deadline"
            if not waits:
                assert r.pending is None and not r.evict_next
        elif evict_next_before or now < retry_before or not r.connected:
            assert not waits and not r.evict_next, "after a refusal: evict once, then cool down"
        else:
            victims = self.bm.eviction_order(n)
            assert waits == bool(victims)
            event(f"asked about {len(victims)} victims")
            if waits:
                report = r.outbox[-1]
                assert len(r.outbox) == sent_before + 1 and r.pending == report.release_id
                assert report.num_victims == len(victims)
                assert [self.bm.hash_to_block[h] for h in report.hashes[-report.num_victims:]] == sorted(
                    victims, key=lambda b: [self.bm.hash_to_block[h] for h in report.hashes].index(b))
                seen = {ROOT_HASH}
                for h, parent, g in zip(report.hashes, report.parents, report.generations):
                    block = self.bm.blocks[self.bm.hash_to_block[h]]
                    assert parent in seen, "parents before children, every ancestor included"
                    assert block.generation == g
                    seen.add(h)
                assert report.expected_reuses == sum(self.bm.blocks[b].hits for b in victims) / len(victims)

    @precondition(lambda self: self.release.pending is not None)
    @rule(state=st.sampled_from(["done", "refused", "aborted"]), stale=st.booleans())
    def outcome(self, state, stale):
        r = self.release
        pending = r.pending
        r.on_outcome(ReleaseOutcome(pending + 1000 if stale else pending, state))
        if stale:
            assert r.pending == pending, "an answer to another release changes nothing"
        else:
            assert r.pending is None and r.evict_next == (state != "done")

    @rule(lost=st.booleans())
    def control_plane(self, lost):
        r = self.release
        if lost:
            r.disconnected()
            assert r.pending is None and not r.on_shortage([], 1), "nobody to ask: evict"
        else:
            r.connected = True  # a new control process attached

    @rule(dt=st.floats(0, 1.5))
    def time_passes(self, dt):
        self.clock.now += dt

    @invariant()
    def accounting(self):
        self.bm.check_invariants([s.block_table for s in self.live])
        assert self.release.pending is None or self.release.deadline <= self.clock.now + self.release.wait_s


TestReleaseMachine = ReleaseMachine.TestCase
TestReleaseMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_the_scheduler_asks_before_evicting_and_waits_while_told():
    bm = BlockManager(6, BLOCK)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    cold = prefill(bm, [5] * 12 + [6], "cold")
    bm.free(cold)  # 3 cached blocks, reclaimable
    asked = []
    answer = [True]
    sched.on_shortage = lambda hit, n: asked.append(n) or answer[0]
    seq = Sequence("new", [9] * 17, PARAMS, BLOCK)  # 5 blocks, 3 free: evicts 2
    sched.add(seq)
    assert sched.schedule().seqs == [] and asked == [2] and sched.waiting[0] is seq
    answer[0] = False
    assert sched.schedule().seqs == [seq] and asked == [2, 2]
    assert bm.num_reclaimable == 1, "evicted as it always did"
    sched.abort(seq)
    small = Sequence("small", [8] * 3, PARAMS, BLOCK)
    sched.add(small)
    assert sched.schedule().seqs == [small] and asked == [2, 2], "no shortage, no question"
