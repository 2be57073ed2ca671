"""``lmpool.control.transfers.data_paths``: a broken pair is connected again once idle, once."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmpool.control.transfers.data_paths import DataPaths
from lmpool.protocol import Connect

WORLD = 4


class Rig:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Connect]] = []
        self.open: dict[tuple[int, int], int] = {}  # plans open per pair (low rank first)
        self.dead: set[int] = set()
        self.sessions = iter(range(1, 10**6))
        self.paths = DataPaths(lambda rank, order: self.sent.append((rank, order)),
                               lambda a, b: self.open.get((min(a, b), max(a, b)), 0) > 0,
                               lambda rank: rank not in self.dead, session=lambda: next(self.sessions))

    def take(self) -> list[tuple[int, Connect]]:
        sent, self.sent = self.sent, []
        return sent


def test_every_pair_is_connected_at_start_under_one_session_each():
    rig = Rig()
    rig.paths.connect_all([2, 0, 1])
    assert rig.take() == [(0, Connect(1, 1)), (1, Connect(0, 1)), (0, Connect(2, 2)), (2, Connect(0, 2)),
                          (1, Connect(2, 3)), (2, Connect(1, 3))]
    assert rig.paths.reconnects == 0


def test_a_broken_pair_waits_for_its_last_plan_then_connects_once():
    rig = Rig()
    rig.open[(0, 1)] = 1
    rig.paths.mark_broken(1, 0)
    rig.paths.settle()
    assert rig.take() == [] and rig.paths.broken == {(0, 1)}, "a new connection would fail the open plan"
    rig.open[(0, 1)] = 0
    rig.paths.settle()
    rig.paths.settle()
    assert rig.take() == [(0, Connect(1, 1)), (1, Connect(0, 1))] and rig.paths.reconnects == 1
    assert rig.paths.broken == set()


def test_a_pair_with_a_dead_rank_is_forgotten_and_a_rank_is_no_pair_with_itself():
    rig = Rig()
    rig.paths.mark_broken(2, 2)
    rig.paths.mark_broken(2, 3)
    rig.dead.add(3)
    rig.paths.settle()
    assert rig.take() == [] and rig.paths.broken == set() and rig.paths.reconnects == 0


class DataPathsMachine(RuleBasedStateMachine):
    """Plans open and end, ranks die, plans fail on their data path, the plane settles after
    each answer: a pair is connected again only when idle and both alive, once per break."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig()
        self.expected = 0  # reconnects the model predicts

    pairs = st.tuples(st.integers(0, WORLD - 1), st.integers(0, WORLD - 1)).filter(lambda p: p[0] != p[1])

    @rule(pair=pairs)
    def open_plan(self, pair):
        key = (min(pair), max(pair))
        self.rig.open[key] = self.rig.open.get(key, 0) + 1

    @rule(pair=pairs, broke=st.booleans())
    def end_plan(self, pair, broke):
        key = (min(pair), max(pair))
        if self.rig.open.get(key, 0) == 0:
            return
        if broke:
            self.rig.paths.mark_broken(*pair)
        self.rig.open[key] -= 1
        self.settle()

    @rule(rank=st.integers(0, WORLD - 1))
    def die(self, rank):
        self.rig.dead.add(rank)
        self.settle()

    def settle(self):
        ready = {(a, b) for a, b in self.rig.paths.broken
                 if a not in self.rig.dead and b not in self.rig.dead and not self.rig.open.get((a, b), 0)}
        self.rig.paths.settle()
        sent = self.rig.take()
        assert sorted((min(r, o.peer), max(r, o.peer)) for r, o in sent) == sorted(p for p in ready for _ in (0, 1))
        for (r1, o1), (r2, o2) in zip(sent[::2], sent[1::2]):
            assert (r1, o1.peer) == (o2.peer, r2) and o1.session == o2.session, "one session, both ends"
        self.expected += len(ready)

    @invariant()
    def broken_pairs_are_live_distinct_and_waiting(self):
        for a, b in self.rig.paths.broken:
            assert a < b and a not in self.rig.dead and b not in self.rig.dead
            assert self.rig.open.get((a, b), 0) > 0, "an idle broken pair of live ranks was left unconnected"
        assert self.rig.paths.reconnects == self.expected


TestDataPathsMachine = DataPathsMachine.TestCase
TestDataPathsMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
