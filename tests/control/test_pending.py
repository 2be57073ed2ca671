"""PendingPrefixes: a rank's routed-but-unreported blocks extend its match while they live; checked
against a plain model (per rank, hash -> expiry in insertion order) after every step."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmpool.control.routing.pending import PendingPrefixes
from control_testkit import ManualClock

TTL = 3.0
CAP = 6
hashes = st.lists(st.integers(1, 9), max_size=5)


def test_extend_counts_only_a_live_contiguous_run_after_the_match():
    clock = ManualClock()
    p = PendingPrefixes(2, TTL, clock)
    p.add(0, [3, 4, 5])
    assert p.extend(0, [1, 2, 3, 4, 5, 6], matched=2) == 5
    assert p.extend(0, [1, 2, 3, 4, 5, 6], matched=1) == 1, "block 2 is neither held nor pending"
    assert p.extend(1, [1, 2, 3, 4, 5, 6], matched=2) == 2, "another rank's pending blocks"
    clock.now += TTL
    assert p.extend(0, [1, 2, 3, 4, 5, 6], matched=2) == 2, "expired"
    with pytest.raises(ValueError):
        PendingPrefixes(0, TTL, clock)
    with pytest.raises(ValueError):
        PendingPrefixes(1, 0, clock)


class PendingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.pending = PendingPrefixes(2, TTL, self.clock, max_entries=CAP)
        self.model: list[dict[int, float]] = [{}, {}]  # insertion-ordered, like the real thing

    @rule(rank=st.integers(0, 1), block_hashes=hashes)
    def add(self, rank, block_hashes):
        self.pending.add(rank, block_hashes)
        entries = self.model[rank]
        for h in list(entries):
            if entries[h] <= self.clock.now:
                del entries[h]
        for h in block_hashes:
            entries.pop(h, None)
            entries[h] = self.clock.now + TTL
        while len(entries) > CAP:
            del entries[next(iter(entries))]

    @rule(dt=st.sampled_from([0.5, 1.0, TTL]))
    def advance(self, dt):
        self.clock.now += dt

    @rule(rank=st.integers(0, 1), h=st.integers(1, 9))
    def confirm(self, rank, h):
        self.pending.confirm(rank, h)
        self.model[rank].pop(h, None)

    @rule(rank=st.integers(0, 1))
    def drop(self, rank):
        self.pending.drop_rank(rank)
        self.model[rank].clear()

    @rule(rank=st.integers(0, 1), block_hashes=hashes, matched=st.integers(0, 3))
    def extend(self, rank, block_hashes, matched):
        matched = min(matched, len(block_hashes))
        n = matched
        while n < len(block_hashes) and self.model[rank].get(block_hashes[n], -1.0) > self.clock.now:
            n += 1
        assert self.pending.extend(rank, block_hashes, matched) == n >= matched

    @rule(block_hashes=hashes, matched=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def extend_ranks(self, block_hashes, matched):
        """A route's call for all its candidates: what ``extend`` gives each, in place."""
        matched = [min(m, len(block_hashes)) for m in matched]
        expected = [self.pending.extend(r, block_hashes, m) for r, m in enumerate(matched)]
        self.pending.extend_ranks((0, 1), block_hashes, matched)
        assert matched == expected

    @invariant()
    def bounded(self):
        assert all(len(entries) <= CAP for entries in self.pending._ranks)

    @invariant()
    def live_entries_as_the_model_and_the_rest_expired(self):
        # An add drops only its share of the expired (``add``'s bound), so some may linger: never live.
        now = self.clock.now
        for real, model in zip(self.pending._ranks, self.model):
            assert {h: e for h, e in real.items() if e > now} == {h: e for h, e in model.items() if e > now}


def test_an_add_drops_at_most_twice_what_it_adds_of_the_expired():
    clock = ManualClock()
    pending = PendingPrefixes(1, TTL, clock)
    pending.add(0, list(range(100, 150)))
    clock.now += TTL  # all 50 expired
    pending.add(0, [1, 2])
    assert len(pending) == 50 - 5 + 2  # 2 * 2 + 1 of the expired dropped, the two added kept
    assert pending.extend(0, list(range(100, 150)), 0) == 0  # the expired that linger never count
    for _ in range(20):
        pending.add(0, [3])
    assert len(pending) == 3  # the backlog drains: every add takes its share


TestPendingMachine = PendingMachine.TestCase
TestPendingMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
