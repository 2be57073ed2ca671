"""BlockManager: a stateful property test over random allocate/compute/append/free/reclaim
sequences, with every invariant and the delta/snapshot agreement checked after each step."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmpool.engine.block_manager import BlockManager, BlockState
from lmpool.engine.hashing import ROOT_HASH, block_hash, chain_hashes
from lmpool.engine.sequence import Sequence
from lmpool.sampling_params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=1)
# A few shared stems make prefix hits (and collisions of partial chains) common.
STEMS = [[1] * 8, [1] * 4 + [2] * 4, [3, 1, 4, 1, 5, 9, 2, 6]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.seqs: list[Sequence] = []
        self.raw: list[int] = []  # blocks held outside any sequence
        self.mirror: dict[int, tuple[int, int]] = {}  # hash -> (block_id, generation), from deltas
        self.mirror_version = 0
        self.n = 0

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(4, 24))
    def create(self, num_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, BLOCK)

    @precondition(lambda self: self.bm is not None)
    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=9), chunk=st.integers(1, 12))
    def admit(self, stem: list[int], tail: list[int], chunk: int) -> None:
        self.n += 1
        seq = Sequence(f"r{self.n}", stem[: 1 + len(tail) % 8] + tail if tail else stem, PARAMS, BLOCK)
        hit = self.bm.match_prefix(seq)
        assert len(hit) * BLOCK < len(seq), "a hit must leave a token to compute"
        n = min(chunk, len(seq) - len(hit) * BLOCK)
        fresh = self.bm.blocks_needed(len(hit) * BLOCK + n) - len(hit)
        if not self.bm.can_admit(hit, fresh):
            return
        reclaimable_hits = [b for b in hit if self.bm.blocks[b].state is BlockState.RECLAIMABLE]
        self.bm.admit(seq, hit)
        for b in reclaimable_hits:
            assert self.bm.blocks[b].state is BlockState.READY, "a hit revives a reclaimable block"
        self.bm.grow(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def compute(self, data, chunk: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        n = min(chunk, seq.num_uncomputed_tokens)
        need = self.bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
        if n == 0 or need > self.bm.num_available:
            return
        self.bm.grow(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def rematch(self, data) -> None:
        """A sequence's match, remembered since the cache last changed, is what a fresh one finds."""
        seq = data.draw(st.sampled_from(self.seqs))
        assert self.bm.match_prefix(seq) == self.bm.match_prefix(Sequence("probe", list(seq.token_ids), PARAMS, BLOCK))

    @precondition(lambda self: self.bm is not None)
    @rule()
    def forget(self) -> None:
        """A reset forgets every cached block nobody holds: what stays cached is held, or a held
        block's ancestor; with nothing held, nothing stays."""
        bm = self.bm
        before = len(bm.hash_to_block)
        assert bm.forget_cached() == before - len(bm.hash_to_block)
        assert not any(b.state is BlockState.RECLAIMABLE and b.num_cached_children == 0 for b in bm.blocks)
        if not self.seqs and not self.raw:
            assert not bm.hash_to_block and bm.num_free == bm.num_blocks

    @precondition(lambda self: self.bm is not None)
    @rule(k=st.integers(1, 6))
    def take_raw(self, k: int) -> None:
        """Allocate outside any sequence, forcing dependency-safe reclamation when free runs out."""
        if k <= self.bm.num_available:
            self.raw.extend(self.bm.allocate_blocks(k))

    @precondition(lambda self: self.raw)
    @rule()
    def release_raw(self) -> None:
        self.bm.release(self.raw.pop())

    @invariant()
    def consistent(self) -> None:
        if self.bm is None:
            return
        bm = self.bm
        bm.check_invariants([s.block_table for s in self.seqs] + [[b] for b in self.raw])
        for b in bm.blocks:
            assert not (b.state is BlockState.FREE and b.ref_count), "free and referenced"
        delta = bm.drain_delta()
        assert delta.from_version == self.mirror_version, "delta gap"
        assert delta.to_version - delta.from_version == len(delta.events)
        for ev in delta.events:
            if type(ev).__name__ == "BlockStored":
                assert ev.block_hash not in self.mirror
                self.mirror[ev.block_hash] = (ev.block_id, ev.generation)
            else:
                assert self.mirror.pop(ev.block_hash) == (ev.block_id, ev.generation)
        self.mirror_version = delta.to_version
        snap = bm.snapshot()
        assert snap.version == self.mirror_version
        assert {b.block_hash: (b.block_id, b.generation) for b in snap.blocks} == self.mirror
        seen = {ROOT_HASH}
        for b in snap.blocks:  # parents before children
            assert b.parent_hash in seen
            seen.add(b.block_hash)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_hashes_are_chained_and_stable():
    tokens = list(range(10))
    hashes = chain_hashes(tokens, 4)
    assert len(hashes) == 2
    assert hashes[1] == block_hash(hashes[0], tokens[4:8])
    assert chain_hashes(tokens, 4, hashes[:1]) == hashes


def test_hashes_agree_across_processes():
    """Python's hash() is salted per process; block hashes must not be."""
    code = "from lmpool.engine.hashing import chain_hashes; print(chain_hashes(list(range(10)), 4))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{chain_hashes(list(range(10)), 4)}\n"}


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(8, BLOCK)
    a = Sequence("a", [1, 2, 3, 4, 5], PARAMS, BLOCK)
    bm.admit(a, bm.match_prefix(a))
    bm.grow(a, 5)
    a.num_computed_tokens = 5
    bm.commit(a)
    b = Sequence("b", [9, 9, 9, 9, 5], PARAMS, BLOCK)
    b.block_hashes = list(a.block_hashes)  # pretend the 64-bit hashes collide
    assert bm.match_prefix(b) == []
    c = Sequence("c", [1, 2, 3, 4, 7], PARAMS, BLOCK)
    assert bm.match_prefix(c) == a.block_table[:1]



def test_a_prompt_off_the_wire_hits_what_a_list_prompt_cached_and_its_tokens_stay_ints():
    """A pool worker's prompt arrives as an int32 array (``unpack_ids``) and becomes the sequence's
    token array by one copy; its blocks compare as bytes with those a list prompt cached, and a
    block received by a transfer is verified the same way."""
    bm = BlockManager(8, BLOCK)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS, BLOCK)
    bm.admit(a, bm.match_prefix(a))
    bm.grow(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    wire = np.array([1, 2, 3, 4, 5, 6, 7, 8, 7], dtype=np.int32)
    b = Sequence("b", wire, PARAMS, BLOCK, [11, 12])
    assert list(b.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 7, 11, 12] and b.num_prompt_tokens == 9
    assert b.output_token_ids == [11, 12] and type(b.output_token_ids) is list
    assert b.block_hashes == chain_hashes(wire.tolist() + [11, 12], BLOCK)
    assert bm.match_prefix(b) == a.block_table[:2]
    c = Sequence("c", np.array([1, 2, 3, 4, 5, 6, 7, 9, 7], dtype=np.int32), PARAMS, BLOCK)
    assert bm.match_prefix(c) == a.block_table[:1]  # its second block differs in one id
    # A block received by transfer: its tokens arrive as a list, and verify as bytes too.
    other = BlockManager(8, BLOCK)
    landed = other.allocate_blocks(1)
    other.publish_received(landed, a.block_hashes[:1], [ROOT_HASH], [[1, 2, 3, 4]])
    assert other.match_prefix(Sequence("d", wire, PARAMS, BLOCK)) == landed

def test_a_remembered_match_is_another_managers_or_an_older_caches_never():
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS, BLOCK)
    bm = BlockManager(8, BLOCK)
    bm.admit(a, bm.match_prefix(a))
    bm.grow(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    q = Sequence("q", [1, 2, 3, 4, 5, 6, 7, 8, 0], PARAMS, BLOCK)
    assert bm.match_prefix(q) == a.block_table[:2]
    other = BlockManager(8, BLOCK)
    other.version = bm.version  # another manager at the same cache version: its own match
    assert other.match_prefix(q) == []
    bm.free(a)
    bm.allocate_blocks(8)  # reclaims both cached blocks: the cache changed
    assert bm.match_prefix(q) == []


def test_reclaims_least_frequently_then_least_recently_used_leaf():
    bm = BlockManager(6, BLOCK)
    seqs = []
    for i, stem in enumerate(([1] * 5, [2] * 5, [3] * 5)):
        s = Sequence(f"s{i}", stem, PARAMS, BLOCK)
        bm.admit(s, [])
        bm.grow(s, 5)
        s.num_computed_tokens = 5
        bm.commit(s)
        seqs.append(s)
    cached = [s.block_table[0] for s in seqs]
    for s in seqs:
        bm.free(s)
    # Hit the first stem again: it becomes the most frequently used.
    again = Sequence("again", [1] * 5, PARAMS, BLOCK)
    bm.admit(again, bm.match_prefix(again))
    bm.free(again)
    bm.allocate_blocks(4)  # three free blocks, then one reclaimed: the LRU of the unhit ones
    assert bm.blocks[cached[1]].block_hash is None
    assert bm.blocks[cached[0]].block_hash is not None
    assert bm.blocks[cached[2]].block_hash is not None


def _compute_all(bm: BlockManager, seq: Sequence) -> None:
    bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def test_duplicate_prefix_computed_twice_keeps_one_chain():
    """Two sequences prefill the same first block at once: only the first copy is cached, and
    the second's next block does not hang off its own uncached copy of the parent."""
    bm = BlockManager(16, BLOCK)
    a = Sequence("a", [7] * 9, PARAMS, BLOCK)
    b = Sequence("b", [7] * 4 + [8] * 5, PARAMS, BLOCK)
    bm.admit(a, bm.match_prefix(a))
    bm.admit(b, bm.match_prefix(b))  # nothing is cached yet: both compute everything
    _compute_all(bm, a)
    _compute_all(bm, b)
    bm.check_invariants([a.block_table, b.block_table])
    assert [bm.hash_to_block[h] for h in a.block_hashes] == a.block_table[:2]
    assert all(bm.blocks[x].block_hash is None for x in b.block_table)
    bm.free(a)  # a's chain is now reclaimable while b still runs
    held = bm.allocate_blocks(bm.num_available)
    bm.check_invariants([b.block_table] + [[x] for x in held])
