"""Scheduler admission: a waiting sequence whose prefix another sequence is computing right now is
passed over until that prefix is cached, never computed twice in one step, and never starved;
checked step by step on random traces of shared prefixes (no model: the steps are simulated)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.scheduler import ScheduledBatch, Scheduler
from lmpool.engine.sequence import Sequence, SequenceStatus
from lmpool.sampling_params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prompt(prefix: int, prefix_blocks: int, tail: int) -> list[int]:
    return [prefix * 100 + i for i in range(prefix_blocks * BLOCK)] + [9000 + tail, 9100 + tail]


def step(sched: Scheduler):
    """One simulated model step: what was scheduled is computed (no token is sampled)."""
    batch = sched.schedule()
    sched.complete_step(batch)
    for seq, n in zip(batch.seqs, batch.num_tokens):
        if seq.num_computed_tokens == len(seq):
            sched.running.remove(seq)
            sched.finish(seq, "length")
    return batch


def test_a_sequence_whose_prefix_is_being_computed_waits_then_hits_and_others_pass_it():
    bm = BlockManager(64, BLOCK)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)  # 2 blocks a step: 3 steps of prefix
    first = Sequence("a", prompt(1, 6, 0), PARAMS, BLOCK)
    second = Sequence("b", prompt(1, 6, 1), PARAMS, BLOCK)
    other = Sequence("c", [7, 7], PARAMS, BLOCK)
    for seq in (first, second, other):
        sched.add(seq)
    batch = step(sched)
    assert batch.seqs == [first], "the budget went to the producer"
    assert list(sched.waiting) == [second, other]
    sched.max_num_batched_tokens = 64
    batch = step(sched)
    assert second not in batch.seqs and other in batch.seqs, "passed over, without blocking the next one"
    assert sched.waiting[0] is second
    while second.num_computed_tokens == 0:
        step(sched)
    assert second.num_cached_tokens == 6 * BLOCK, "it found the whole prefix cached"


def test_without_a_prefix_cache_no_one_is_passed_over():
    bm = BlockManager(64, BLOCK, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = (Sequence(r, prompt(1, 3, i), PARAMS, BLOCK) for i, r in enumerate("ab"))
    sched.add(a)
    sched.add(b)
    assert step(sched).seqs == [a, b]


@settings(max_examples=80, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(0, 5)), min_size=1, max_size=12),
       budget=st.integers(2, 40), max_seqs=st.integers(1, 6), arrivals=st.lists(st.integers(0, 3), max_size=12))
def test_no_block_is_computed_twice_in_a_step_and_everyone_finishes(requests, budget, max_seqs, arrivals):
    bm = BlockManager(256, BLOCK)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    seqs = [Sequence(f"r{i}", prompt(p, n, t), PARAMS, BLOCK) for i, (p, n, t) in enumerate(requests)]
    pending = list(seqs)
    for steps in range(2000):
        for _ in range(arrivals[steps] if steps < len(arrivals) else len(pending)):  # a few arrive per step
            if pending:
                sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        before = {id(s): s.num_computed_tokens for s in seqs}
        batch = sched.schedule()
        computed = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            assert start >= before[id(seq)]  # an admission may start past a prefix hit
            first, end = -(-start // BLOCK), (start + n) // BLOCK  # complete blocks this step finishes
            computed += seq.block_hashes[first:end]
        assert len(computed) == len(set(computed)), "two sequences computed one block in the same step"
        sched.complete_step(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens == len(seq):
                sched.running.remove(seq)
                sched.finish(seq, "length")
        bm.check_invariants([s.block_table for s in sched.running])
    assert not pending and not sched.has_unfinished(), "every request was admitted and finished"


@given(st.lists(st.tuples(st.integers(1, 3), st.booleans()), max_size=12))
def test_a_batch_lists_its_single_token_rows_first_each_part_in_its_order(rows):
    """``decode_first``: a permutation, single-token rows first, each part in scheduling order,
    the prompt-logprob indices still naming the same sequences."""
    batch = ScheduledBatch()
    for i, (n, asks) in enumerate(rows):
        seq = Sequence(f"s{i}", list(range(8)), SamplingParams(max_tokens=1, prompt_logprobs=1 if asks else None),
                       BLOCK)
        seq.num_computed_tokens = 0 if asks else 8 - n
        batch.add(seq, n)
    before = list(zip(batch.seqs, batch.num_tokens))
    asking = {batch.seqs[i].request_id for i in batch.prompt_logprobs}
    batch.decode_first()
    after = list(zip(batch.seqs, batch.num_tokens))
    assert sorted(after, key=lambda p: p[0].request_id) == sorted(before, key=lambda p: p[0].request_id)
    assert after == [p for p in before if p[1] == 1] + [p for p in before if p[1] != 1]
    assert {batch.seqs[i].request_id for i in batch.prompt_logprobs} == asking
    assert batch.prompt_logprobs == sorted(batch.prompt_logprobs)


class SchedulerMachine(RuleBasedStateMachine):
    """Requests over a few shared prefixes arrive, steps run (each computes what was scheduled; a
    sequence whose tokens are all computed takes a new one, until its output is long enough),
    requests abort. After every step: the batch keeps the token budget and the sequence limit,
    lists its single-token rows first, holds running sequences once each, and its prompt-logprob
    indices name the sequences that asked; the block manager's invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(40, BLOCK)
        self.sched = Scheduler(self.bm, max_num_seqs=5, max_num_batched_tokens=12)
        self.n = 0
        self.live: list[Sequence] = []

    @rule(stem=st.integers(0, 2), tail=st.integers(1, 9), out=st.integers(1, 4), asks=st.booleans())
    def add(self, stem: int, tail: int, out: int, asks: bool) -> None:
        self.n += 1
        params = SamplingParams(temperature=0, max_tokens=out, prompt_logprobs=1 if asks else None)
        seq = Sequence(f"r{self.n}", prompt(stem, 2, self.n)[: 2 * BLOCK + tail], params, BLOCK)
        self.sched.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self) -> None:
        batch = self.sched.schedule()
        self.check(batch)
        self.sched.complete_step(batch)
        for seq in batch.seqs:
            if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 0:
                if len(seq) - seq.num_prompt_tokens >= seq.params.max_tokens:
                    self.sched.retire(seq, "length")
                    self.live.remove(seq)
                else:
                    seq.append_token(7)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.sched.abort(seq)
        self.live.remove(seq)

    def check(self, batch: ScheduledBatch) -> None:
        counts = batch.num_tokens
        assert sum(counts) <= self.sched.max_num_batched_tokens and len(batch.seqs) <= self.sched.max_num_seqs
        assert all(n >= 1 for n in counts)
        singles = sum(n == 1 for n in counts)
        if 0 < singles < len(counts):
            event("a mixed batch")
        assert all(n == 1 for n in counts[:singles]) and batch.decode_seqs == singles
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        assert all(s.status is SequenceStatus.RUNNING and s in self.sched.running for s in batch.seqs)
        for i in batch.prompt_logprobs:
            assert batch.seqs[i].params.prompt_logprobs is not None

    @invariant()
    def blocks_consistent(self) -> None:
        self.bm.check_invariants([s.block_table for s in self.sched.running])


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
