"""A hypothesis state machine over route-time pull bookkeeping: requests routed over a few
cached documents while pulls progress, fail, time out and lose ranks (which come back as new
incarnations). After every step the page table's and ``RoutePulls``' invariants hold, every
waiting request waits on one open pull, every request is released at most once and only by
its own pull's end, and once no plan is open nothing is in flight anywhere."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pull_rig import PullRig

WORLD = 3
DOCS = [[d * 1000 + i for i in range(1, 13)] for d in range(3)]  # 12-block documents


class PullMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rig = PullRig(WORLD)
        self.rig.cache(0, DOCS[0])
        self.rig.cache(1, DOCS[1])
        self.released: set[str] = set()

    @rule(doc=st.integers(0, len(DOCS) - 1), depth=st.integers(1, 12), tail=st.integers(1, 8))
    def route(self, doc, depth, tail):
        if not self.rig.gbm.alive_mask:
            return
        _, decision = self.rig.route(DOCS[doc][:depth], tail_tokens=tail)
        assert self.rig.gbm.ranks[decision.rank].alive

    @rule(rank=st.integers(0, WORLD - 1), running=st.integers(0, 200))
    def load(self, rank, running):
        if self.rig.gbm.ranks[rank].alive:
            self.rig.load(rank, running, decode_left=running * 32)

    @precondition(lambda self: self.rig.coordinator.plans)
    @rule(pick=st.integers(0, 1 << 16))
    def advance(self, pick):
        plans = sorted(self.rig.coordinator.plans)
        self.rig.advance(plans[pick % len(plans)])

    @precondition(lambda self: self.rig.coordinator.plans)
    @rule(pick=st.integers(0, 1 << 16))
    def fail(self, pick):
        plans = sorted(self.rig.coordinator.plans)
        self.rig.fail(plans[pick % len(plans)])

    @rule()
    def timeout(self):
        self.rig.clock.now += self.rig.coordinator.phase_timeout_s + 1
        self.rig.coordinator.tick()

    @rule(rank=st.integers(0, WORLD - 1))
    def kill_or_revive(self, rank):
        if self.rig.gbm.ranks[rank].alive:
            self.rig.kill(rank)
        else:
            self.rig.revive(rank)
            self.rig.cache(rank, DOCS[rank % len(DOCS)])

    @invariant()
    def bookkeeping(self):
        rig = self.rig
        rig.check()
        for rid, outcome in rig.resolved[len(self.released):]:
            assert rid not in self.released, f"{rid} released twice"
            assert rid not in rig.pulls.waiting
            assert outcome == "landed" or outcome.startswith("aborted: ")
            self.released.add(rid)
        for rid, plan_id in rig.pulls.waiting.items():
            assert plan_id in rig.coordinator.plans and rid not in self.released


TestPullMachine = PullMachine.TestCase
TestPullMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
