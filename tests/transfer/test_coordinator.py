"""The control plane's transfer state machine driving real worker-side participants in one
process: phase messages are delivered late, twice or never, ranks die, the watchdog fires;
after every step the block accounting holds on every rank, the page table's invariants hold,
and no plan leaks a reservation once everything has ended."""

from __future__ import annotations

import random

import pytest

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.engine.block_manager import BlockManager, StaleBlockError
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol import LoadReport
from lmpool.control.transfers.coordinator import TransferCoordinator
from lmpool.protocol import (
    SUCCESS,
    PlanState,
    DestPrepared,
    Executed,
    ExecuteRecv,
    ExecuteSend,
    Finalize,
    PhaseFailed,
    PrepareDest,
    PrepareSource,
    Publish,
    SourcePrepared,
    TransferOrder,
)
from lmpool.dataplane.transactions import StalePlanError, TransferParticipant
from block_testkit import prefill

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """N simulated workers (BlockManager + TransferParticipant) and one control plane."""

    def __init__(self, world: int, blocks: int, seed: int, pulls: bool = False) -> None:
        self.rng = random.Random(seed)
        self.pulls = pulls  # destinations read the source's blocks themselves (CUDA IPC)
        self.clock = Clock()
        self.gbm = GlobalBlockManager(world, BLOCK, clock=self.clock)
        self.inbox: list[tuple[int, TransferOrder]] = []
        self.coord = TransferCoordinator(self.gbm, lambda r, m: self.inbox.append((r, m)), phase_timeout_s=1.0,
                                         clock=self.clock)
        self.world, self.blocks = world, blocks
        self.bms: list[BlockManager] = []
        self.parts: list[TransferParticipant] = []
        self.epochs = [0] * world
        for r in range(world):
            self.restart(r)

    def restart(self, rank: int) -> None:
        """A fresh worker process for ``rank`` (its predecessor's blocks are gone)."""
        if len(self.bms) <= rank:
            self.bms.append(None)
            self.parts.append(None)
        self.bms[rank] = BlockManager(self.blocks, BLOCK)
        self.parts[rank] = TransferParticipant(self.bms[rank], lease_s=3.0, clock=self.clock)
        self.epochs[rank] += 1
        bm = self.bms[rank]
        self.gbm.register_rank(rank, self.epochs[rank], bm.num_blocks)
        self.gbm.apply_snapshot(rank, self.epochs[rank], bm.snapshot())

    def sync(self, rank: int) -> None:
        bm = self.bms[rank]
        assert self.gbm.apply_delta(rank, self.epochs[rank], bm.drain_delta())
        self.gbm.update_load(rank, self.epochs[rank], LoadReport(blocks_free=bm.num_free,
                                                                   blocks_reclaimable=bm.num_reclaimable))

    def cache_prefix(self, rank: int) -> None:
        bm = self.bms[rank]
        tokens = [self.rng.randrange(3) for _ in range(self.rng.choice((4, 8, 12)))] + [9]
        seq = prefill(bm, tokens, "s")
        if seq is not None:
            bm.free(seq)
        self.sync(rank)

    def start_plan(self, src: int, dst: int) -> None:
        """Copy or move a cached chain of ``src`` that ``dst`` lacks (destination absence)."""
        bm = self.bms[src]
        if not bm.hash_to_block:
            return
        leaf = self.rng.choice(sorted(bm.hash_to_block.values()))
        chain = [leaf]
        while bm.blocks[chain[-1]].parent_id is not None:
            chain.append(bm.blocks[chain[-1]].parent_id)
        blocks = [bm.blocks[b] for b in reversed(chain)]
        hashes = [b.block_hash for b in blocks]
        if any(self.gbm.ready_ranks(h) >> dst & 1 for h in hashes):
            return
        busy = {h for p in self.coord.plans.values() if p.dst == dst for h in p.hashes}
        if busy & set(hashes):
            return  # another plan is already bringing these blocks there
        self.coord.start(src, dst, hashes, [b.generation for b in blocks],
                         [ROOT_HASH] + hashes[:-1], move=self.rng.random() < 0.5)

    def deliver(self, index: int) -> None:
        rank, msg = self.inbox.pop(index)
        part = self.parts[rank]
        try:
            if isinstance(msg, PrepareSource):
                plan = part.prepare_source(msg.plan_id, msg.hashes, msg.generations)
                answer = SourcePrepared(msg.plan_id, rank, plan.block_ids, plan.token_ids, held_s=SOURCE_HELD_S)
            elif isinstance(msg, PrepareDest):
                ids = part.prepare_dest(msg.plan_id, msg.num_blocks).block_ids
                answer = DestPrepared(msg.plan_id, rank, ids, [self.bms[rank].blocks[b].generation for b in ids])
            elif isinstance(msg, (ExecuteSend, ExecuteRecv)):
                part.executed(msg.plan_id)
                answer = Executed(msg.plan_id, rank, pulled=self.pulls and isinstance(msg, ExecuteRecv))
            elif isinstance(msg, Publish):
                part.publish(msg.plan_id, msg.hashes, msg.parents, msg.token_ids)
                answer = SUCCESS[msg.phase](msg.plan_id, rank)
            elif isinstance(msg, Finalize):
                part.finalize(msg.plan_id, msg.move, msg.keep)
                answer = SUCCESS[msg.phase](msg.plan_id, rank)
            else:
                part.abort(msg.plan_id)
                return
        except (StaleBlockError, StalePlanError, RuntimeError) as e:
            self.sync(rank)
            self.coord.on_ack(PhaseFailed(msg.plan_id, rank, msg.phase.value, str(e)))
            return
        self.sync(rank)
        self.coord.on_ack(answer)

    def check(self) -> None:
        for bm, part in zip(self.bms, self.parts):
            bm.check_invariants(part.held_blocks())
        self.gbm.check_invariants()
        for plan in self.coord.plans.values():
            for h in plan.marked:  # a reserved, unpublished copy is never routable
                assert not self.gbm.ready_ranks(h) >> plan.dst & 1

    def step(self, drop: float = 0.05, tick: float = 0.095, kill: float = 0.005) -> None:
        """One random event: cache a prefix, start a plan, deliver a message (sometimes twice),
        lose one, let time pass, or SIGKILL a worker."""
        r = self.rng.random()
        if r < 0.15:
            self.cache_prefix(self.rng.randrange(self.world))
        elif r < 0.35:
            src, dst = self.rng.sample(range(self.world), 2)
            self.start_plan(src, dst)
        elif r < 1 - drop - tick - kill:
            if self.inbox:
                i = self.rng.randrange(len(self.inbox))
                if self.rng.random() < 0.1:  # a duplicate arrives later as well
                    self.inbox.append(self.inbox[i])
                self.deliver(i)
        elif r < 1 - tick - kill:
            if self.inbox:
                self.inbox.pop(self.rng.randrange(len(self.inbox)))  # lost: only a watchdog can end it
        elif r < 1 - kill:
            self.clock.now += 0.3
            self.coord.tick()
            self.expire_all()
        else:
            rank = self.rng.randrange(self.world)  # SIGKILL: the worker and its state are gone
            self.inbox = [(r2, m) for r2, m in self.inbox if r2 != rank]
            self.coord.rank_died(rank)
            self.gbm.mark_dead(rank)
            self.restart(rank)
        self.check()

    def expire_all(self) -> None:
        for rank, part in enumerate(self.parts):
            if part.expire():
                self.sync(rank)

    def drain(self) -> None:
        """Deliver everything still queued and let the watchdog end whatever is stuck."""
        for _ in range(10_000):
            if self.inbox:
                self.deliver(0)
            elif self.coord.plans:
                self.clock.now += 2.0
                self.coord.tick()
            else:
                break
            self.check()
        while self.inbox:  # the aborts the watchdog sent
            self.deliver(0)
        self.clock.now += 10.0  # past every worker's lease: plans whose aborts were lost end too
        self.expire_all()
        self.check()
        assert not self.coord.plans
        for part in self.parts:
            assert part.held_blocks() == [], "a plan leaked a reservation or a pin"


@pytest.mark.parametrize("pulls", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_faults_keep_every_invariant(seed, pulls):
    """Messages arrive in any order here (a pull's finalize may reach its source before the
    execute order it no longer waits for: the plan then ends, the copy published)."""
    cluster = Cluster(world=3, blocks=24, seed=seed, pulls=pulls)
    for _ in range(1500):
        cluster.step()
    cluster.drain()
    assert cluster.coord.completed > 0 and cluster.coord.aborted > 0


def test_ten_thousand_concurrent_transactions_on_four_ranks():
    cluster = Cluster(world=4, blocks=64, seed=99)
    while cluster.coord.completed + cluster.coord.aborted < 10_000:
        cluster.step(drop=0.002, tick=0.01, kill=0.0005)
        # Simultaneous opposite-direction moves on one pair, often.
        if cluster.rng.random() < 0.1:
            cluster.start_plan(0, 1)
            cluster.start_plan(1, 0)
    cluster.drain()
    assert cluster.coord.completed > 100  # most end by abort: evictions, full destinations, kills


def test_published_copy_serves_the_same_tokens():
    cluster = Cluster(world=2, blocks=16, seed=5)
    for _ in range(4):
        cluster.cache_prefix(0)
    src = cluster.bms[0]
    cluster.start_plan(0, 1)
    plan = next(iter(cluster.coord.plans.values()))
    while cluster.inbox:
        cluster.deliver(0)
    assert cluster.coord.completed == 1
    dst = cluster.bms[1]
    for h in plan.hashes:
        assert list(dst.blocks[dst.hash_to_block[h]].token_ids) == plan.token_ids[plan.hashes.index(h)]
        assert cluster.gbm.ready_ranks(h) >> 1 & 1, "routing sees the published copy"
    if plan.move:
        assert not any(h in src.hash_to_block for h in plan.hashes[-1:]), "a move frees the source suffix"


def test_a_partial_move_keeps_its_ancestors_and_counts_copied_and_moved_blocks():
    """A foreground-style plan: the chain's first block travels as an ancestor (``keep=1``), the
    rest is moved; the source keeps the ancestor and frees the rest."""
    cluster = Cluster(world=2, blocks=16, seed=3)
    bm = cluster.bms[0]
    seq = prefill(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0], "s")
    bm.free(seq)
    cluster.sync(0)
    blocks = [bm.blocks[bm.hash_to_block[h]] for h in seq.block_hashes]
    hashes = [b.block_hash for b in blocks]
    plan = cluster.coord.start(0, 1, hashes, [b.generation for b in blocks], [ROOT_HASH] + hashes[:-1],
                               move=True, keep=1, kind="foreground")
    finalize = []
    while cluster.inbox:
        rank, msg = cluster.inbox[0]
        if isinstance(msg, Finalize):
            finalize.append({"move": msg.move, "num_blocks": msg.keep})
        cluster.deliver(0)
    assert finalize == [{"move": True, "num_blocks": 1}]
    assert cluster.coord.completed == 1 and plan.kind == "foreground"
    assert (cluster.coord.blocks_copied, cluster.coord.blocks_moved) == (1, 2)
    assert list(bm.hash_to_block) == hashes[:1], "the source keeps the ancestor and frees the moved blocks"
    assert all(h in cluster.bms[1].hash_to_block for h in hashes)
    with pytest.raises(ValueError, match="keep=4"):
        cluster.coord.start(0, 1, hashes, [1, 1, 1], [ROOT_HASH] + hashes[:-1], move=True, keep=4)
    with pytest.raises(ValueError, match="one or more blocks"):
        cluster.coord.start(0, 1, [], [], [ROOT_HASH])  # a plan of nothing would fail at publish
    with pytest.raises(ValueError, match="2 generations"):
        cluster.coord.start(0, 1, hashes, [1, 1], [ROOT_HASH] + hashes[:-1])
    assert not cluster.coord.plans and not cluster.inbox, "a refused plan sends no order"


SOURCE_HELD_S = 0.0005  # what the fake source says its prepare orders waited for its step loop


def test_a_done_plan_records_when_each_of_its_phases_ended():
    """The clock moves 1 ms per message delivered: each phase's end is where its last ack landed."""
    cluster = Cluster(world=2, blocks=16, seed=5)
    for _ in range(2):
        cluster.cache_prefix(0)
    cluster.start_plan(0, 1)
    plan = next(iter(cluster.coord.plans.values()))
    ends, prepared = [], {}
    while cluster.inbox:
        cluster.clock.now += 0.001
        state, acked = plan.state, set(plan.acked)
        cluster.deliver(0)
        if state is PlanState.PREPARING:  # which side answered now (the last one ends the phase)
            answered = ({plan.src, plan.dst} - acked) if plan.state is not state else plan.acked - acked
            prepared.update({rank: round(cluster.clock.now - plan.started, 6) for rank in answered})
        if plan.state is not state:
            ends.append(round(cluster.clock.now - plan.started, 6))
    assert cluster.coord.completed == 1 and [round(t, 6) for t in plan.phases] == ends and len(ends) == 4
    summary = cluster.coord.phase_times.summary()
    assert list(summary) == [plan.kind]
    sides = (prepared[plan.src], prepared[plan.dst])
    assert max(sides) == ends[0]
    held = (SOURCE_HELD_S, 0.0)  # as each side said
    assert summary[plan.kind] == {p: [round(t * 1e3, 3), round(t * 1e3, 3), 1]
                                  for p, t in zip(("prepared", "executed", "published", "finalized",
                                                   "source_prepared", "dest_prepared", "source_held", "dest_held"),
                                                  (*plan.phases, *sides, *held))}


def test_phase_times_keep_the_last_plans_of_each_kind():
    from lmpool.control.transfers.phase_times import PhaseTimes

    times = PhaseTimes(keep=2)
    for total in (1.0, 2.0, 4.0):
        times.record("pull", [total / 4, total / 2, total * 3 / 4, total], (total / 8, total / 4), (total / 16, 0.0))
    times.record("background", [0.0, 0.0, 0.0, 0.001], (0.0, 0.0))
    summary = times.summary()
    assert summary["pull"]["finalized"] == [3000.0, 4000.0, 2]  # the first plan is forgotten
    assert summary["pull"]["source_prepared"] == [375.0, 500.0, 2]
    assert summary["pull"]["source_held"] == [187.5, 250.0, 2] and summary["background"]["dest_held"] == [0.0, 0.0, 1]
    assert summary["background"]["finalized"] == [1.0, 1.0, 1]
    with pytest.raises(ValueError):
        times.record("pull", [0.2, 0.1, 0.3, 0.4], (0.1, 0.2))
    with pytest.raises(ValueError):  # a side that answered after the phase it ends
        times.record("pull", [0.2, 0.3, 0.4, 0.5], (0.1, 0.25))


def executing_plan(pulls: bool):
    """A cluster whose one plan (rank 0 to 1) has both execute orders waiting in its inbox."""
    cluster = Cluster(world=2, blocks=16, seed=5, pulls=pulls)
    for _ in range(2):
        cluster.cache_prefix(0)
    cluster.start_plan(0, 1)
    plan = next(iter(cluster.coord.plans.values()))
    while plan.state is not PlanState.EXECUTING:
        cluster.deliver(0)
    return cluster, plan


def index_of(cluster: Cluster, kind: type) -> int:
    return next(i for i, (_, msg) in enumerate(cluster.inbox) if isinstance(msg, kind))


@pytest.mark.parametrize("source_first", [False, True])
def test_a_pull_s_execute_ends_on_the_destination_s_copy(source_first):
    """The destination read the blocks (``pulled``): publish is ordered without the source's
    answer, which the source, busy with a step, gives later (or earlier): it changes nothing. The
    source's execute order goes out before its finalize, so on its FIFO link it is read first."""
    cluster, plan = executing_plan(pulls=True)
    if source_first:
        cluster.deliver(index_of(cluster, ExecuteSend))
        assert plan.state is PlanState.EXECUTING, "the source's answer alone ends nothing"
    cluster.deliver(index_of(cluster, ExecuteRecv))
    assert plan.state is PlanState.PUBLISHING and plan.phases[1] == plan.phases[-1]
    assert [type(m) for _, m in cluster.inbox] == ([Publish] if source_first else [ExecuteSend, Publish])
    while cluster.inbox:
        cluster.deliver(0)
    assert cluster.coord.completed == 1 and cluster.coord.aborted == 0
    assert cluster.parts[0].held_blocks() == cluster.parts[1].held_blocks() == []


def test_a_copy_over_a_packed_path_waits_for_both_sides_to_execute():
    cluster, plan = executing_plan(pulls=False)
    cluster.deliver(index_of(cluster, ExecuteRecv))
    assert plan.state is PlanState.EXECUTING, "the source still sends the bytes"
    cluster.deliver(0)
    assert plan.state is PlanState.PUBLISHING
