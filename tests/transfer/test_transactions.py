"""Transfer transactions between two workers' BlockManagers: a hypothesis state machine
drives random plans through prepare/execute/publish/finalize with aborts, duplicate and
stale messages and allocation pressure on both sides, checking after every step that the
block accounting holds on both ranks, reserved blocks stay invisible, and every published
block carries exactly the tokens its hash names."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmpool.engine.block_manager import BlockManager, BlockState, StaleBlockError
from lmpool.engine.hashing import ROOT_HASH, block_hash
from lmpool.sampling_params import SamplingParams
from lmpool.dataplane.transactions import Phase, StalePlanError, TransferParticipant
from block_testkit import prefill

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=1)
STEMS = [[1] * 12, [1] * 4 + [2] * 8, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


def chain_of(bm: BlockManager, block_id: int) -> list[int]:
    """The cached chain ending at ``block_id``, root first."""
    chain = [block_id]
    while bm.blocks[chain[-1]].parent_id is not None:
        chain.append(bm.blocks[chain[-1]].parent_id)
    return chain[::-1]


class TransferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.src, self.dst = BlockManager(16, BLOCK), BlockManager(12, BLOCK)
        self.ps, self.pd = TransferParticipant(self.src), TransferParticipant(self.dst)
        self.seqs = {"src": [], "dst": []}
        self.raw = {"src": [], "dst": []}
        self.plans: dict[int, dict] = {}  # control plane's view of open plans
        self.next_plan = 0
        self.n = 0

    def side(self, name: str) -> BlockManager:
        return self.src if name == "src" else self.dst

    @rule(side=st.sampled_from(["src", "dst"]), stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=5),
          keep=st.booleans())
    def run_sequence(self, side, stem, tail, keep):
        self.n += 1
        bm = self.side(side)
        seq = prefill(bm, stem + tail, f"s{self.n}")
        if seq is None:
            return
        if keep:
            self.seqs[side].append(seq)
        else:
            bm.free(seq)

    @precondition(lambda self: self.seqs["src"] or self.seqs["dst"])
    @rule(data=st.data())
    def finish_sequence(self, data):
        side = data.draw(st.sampled_from([s for s in ("src", "dst") if self.seqs[s]]))
        seq = self.seqs[side].pop(data.draw(st.integers(0, len(self.seqs[side]) - 1)))
        self.side(side).free(seq)

    @rule(side=st.sampled_from(["src", "dst"]), k=st.integers(1, 5))
    def pressure(self, side, k):
        """Allocate outside any sequence: forces reclamation, which can make planned blocks stale."""
        bm = self.side(side)
        if k <= bm.num_available:
            self.raw[side].extend(bm.allocate_blocks(k))

    @precondition(lambda self: self.raw["src"] or self.raw["dst"])
    @rule(data=st.data())
    def relieve(self, data):
        side = data.draw(st.sampled_from([s for s in ("src", "dst") if self.raw[s]]))
        self.side(side).release(self.raw[side].pop())

    @precondition(lambda self: self.src.hash_to_block)
    @rule(data=st.data(), stale=st.booleans(), skip=st.integers(0, 2))
    def plan(self, data, stale, skip):
        """A chain to copy; ``skip`` leading blocks are left out, as when the destination is
        thought to hold them already (it may not: then the suffix must not be cached there)."""
        # Mostly leaves, so that a move's finalize has a suffix it may free.
        cached = sorted(self.src.hash_to_block.values())
        leaves = [b for b in cached if not self.src.blocks[b].num_cached_children]
        leaf = data.draw(st.sampled_from(leaves if leaves and data.draw(st.booleans()) else cached))
        chain = chain_of(self.src, leaf)
        blocks = [self.src.blocks[b] for b in chain]
        parents = [ROOT_HASH] + [b.block_hash for b in blocks[:-1]]
        skip = min(skip, len(blocks) - 1)
        blocks, parents = blocks[skip:], parents[skip:]
        self.plans[self.next_plan] = dict(
            hashes=[b.block_hash for b in blocks],
            # A stale plan names a generation the block will never reach in this test.
            generations=[b.generation + (1000 if stale and i == len(blocks) - 1 else 0) for i, b in enumerate(blocks)],
            parents=parents,
            phase="planned",
            stale=stale,
        )
        self.next_plan += 1

    def open_plan(self, data, phase):
        return data.draw(st.sampled_from([p for p, plan in self.plans.items() if plan["phase"] == phase]))

    def abort(self, pid):
        self.ps.abort(pid)
        self.pd.abort(pid)
        assert self.ps.outcome(pid) in (Phase.ABORTED, Phase.FINALIZED)
        del self.plans[pid]

    @precondition(lambda self: any(p["phase"] == "planned" for p in self.plans.values()))
    @rule(data=st.data())
    def prepare(self, data):
        pid = self.open_plan(data, "planned")
        plan = self.plans[pid]
        try:
            self.ps.prepare_source(pid, plan["hashes"], plan["generations"])
            self.pd.prepare_dest(pid, len(plan["hashes"]))
        except StaleBlockError:
            event("stale prepare rejected")
            assert self.ps.outcome(pid) is None, "a stale prepare pins nothing"
            return self.abort(pid)
        except RuntimeError:  # the destination has no room
            return self.abort(pid)
        assert not plan["stale"], "a plan naming a reused generation must be rejected"
        assert self.ps.prepare_source(pid, plan["hashes"], plan["generations"]).block_ids  # duplicate: same answer
        plan["phase"] = "prepared"

    @precondition(lambda self: any(p["phase"] == "prepared" for p in self.plans.values()))
    @rule(data=st.data())
    def execute(self, data):
        pid = self.open_plan(data, "prepared")
        # The payload: each source block's content lands in the reserved destination block.
        src_plan, dst_plan = self.ps.plans[pid], self.pd.plans[pid]
        self.plans[pid]["tokens"] = [list(self.src.blocks[b].token_ids) for b in src_plan.block_ids]
        assert all(self.dst.blocks[b].state is BlockState.WRITING for b in dst_plan.block_ids)
        self.ps.executed(pid)
        self.pd.executed(pid)
        self.pd.executed(pid)  # duplicate
        self.plans[pid]["phase"] = "executed"

    @precondition(lambda self: any(p["phase"] == "executed" for p in self.plans.values()))
    @rule(data=st.data())
    def publish(self, data):
        pid = self.open_plan(data, "executed")
        plan = self.plans[pid]
        self.pd.publish(pid, plan["hashes"], plan["parents"], plan["tokens"])
        self.pd.publish(pid, plan["hashes"], plan["parents"], plan["tokens"])  # duplicate: no-op
        plan["phase"] = "published"
        event("published")

    @precondition(lambda self: any(p["phase"] == "published" for p in self.plans.values()))
    @rule(data=st.data(), move=st.booleans(), keep=st.integers(0, 2))
    def finalize(self, data, move, keep):
        pid = self.open_plan(data, "published")
        chain = list(self.ps.plans[pid].block_ids)
        # A partial move: the first ``keep`` blocks were copied along.
        freed = self.ps.finalize(pid, move, keep)
        assert self.ps.finalize(pid, move, keep) == []  # duplicate: no-op
        if not move:
            assert freed == []
        movable = chain[keep:]
        for b in freed:  # only an unreferenced suffix of the chain's movable part is freed
            assert b in movable and self.src.blocks[b].state is BlockState.FREE
        assert freed == movable[len(movable) - len(freed):][::-1]
        event(f"finalized, move={move}, keep={keep}, freed {len(freed)} > 0: {len(freed) > 0}")
        del self.plans[pid]

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def abort_any(self, data):
        pid = data.draw(st.sampled_from(sorted(self.plans)))
        was = self.plans[pid]["phase"]
        held_before = set(self.src.hash_to_block)
        self.abort(pid)
        if was != "published":
            assert held_before <= set(self.src.hash_to_block), "abort keeps the source cached"
        self.ps.abort(pid)  # duplicate: no-op
        with pytest.raises(StalePlanError):
            self.ps.prepare_source(pid, [], [])  # an ended plan cannot be prepared again

    @invariant()
    def accounting(self):
        for name, bm, part in (("src", self.src, self.ps), ("dst", self.dst, self.pd)):
            tables = [s.block_table for s in self.seqs[name]] + [[b] for b in self.raw[name]]
            bm.check_invariants(tables + part.held_blocks())
            for h, b in bm.hash_to_block.items():  # every cached block holds what its hash names
                block = bm.blocks[b]
                parent = bm.blocks[block.parent_id].block_hash if block.parent_id is not None else ROOT_HASH
                assert block_hash(parent, block.token_ids) == h
        for plan in self.pd.plans.values():  # reserved blocks are invisible until publish
            assert all(self.dst.blocks[b].block_hash is None for b in plan.block_ids)
        if not self.plans:
            assert self.ps.held_blocks() == [] and self.pd.held_blocks() == [], "a plan leaked blocks"


TestTransferMachine = TransferMachine.TestCase
TestTransferMachine.settings = settings(max_examples=500, stateful_step_count=80, deadline=None)


def test_unknown_plan_messages():
    p = TransferParticipant(BlockManager(4, BLOCK))
    with pytest.raises(StalePlanError):
        p.publish(7, [], [], [])
    with pytest.raises(StalePlanError):
        p.finalize(7, move=True)
    p.abort(7)  # unknown: no-op, but remembered
    with pytest.raises(StalePlanError):
        p.prepare_dest(7, 1)  # a prepare arriving after its abort must not resurrect the plan
    assert p.held_blocks() == []
