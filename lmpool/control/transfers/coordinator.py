"""The control plane's side of transfer transactions: one state machine per plan id.

    PREPARING --both prepared--> EXECUTING --both executed (CUDA IPC: the destination)--> PUBLISHING
        --destination published--> FINALIZING --source finalized--> DONE
    any phase before DONE --failure, timeout, dead rank--> ABORTED

The coordinator decides nothing about *whether* to transfer (see
``admission``); it runs admitted plans. It talks to workers only through the
``send(rank, message)`` callable it is given, and learns of their progress
through ``on_ack``. While a plan is open, the destination's copies of its
hashes are marked in flight in the GlobalBlockManager, so routing cannot count
them until the destination has published; an abort unmarks them and the
source keeps its blocks.

Invariants: every plan ends (DONE or ABORTED) within ``phase_timeout_s`` of its
last progress (``tick`` is the watchdog); every phase message is sent once per
phase and acknowledged idempotently by the workers; acks for another phase,
or for an ended plan, change nothing. A move's finalize order carries the plan's
``keep`` (``num_blocks``): the leading blocks the source copied but keeps. Over CUDA IPC the
destination reads the source's pinned blocks itself: its ``Executed(pulled=True)`` ends the
execute phase without the source's answer (the source has nothing to do there, and answers only
between its steps: waiting for it cost a whole step of a busy source); the source's order, sent
before its finalize on the same link, still reaches it first.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.transfers.cost_model import TransferCostModel
from lmpool.control.transfers.phase_times import PHASES, PhaseTimes
from lmpool.engine.hashing import ROOT_HASH, short
from lmpool.protocol import (
    SUCCESS,
    AbortPlan,
    DestPrepared,
    Executed,
    ExecuteRecv,
    ExecuteSend,
    Finalize,
    PhaseFailed,
    PlanAnswer,
    PlanState,
    PrepareDest,
    PrepareSource,
    Publish,
    SourcePrepared,
    TransferOrder,
)
from lmpool.protocol.base import BlockHash

PUBLISHED = PHASES.index("published")  # the phase whose end releases the requests a pull holds


@dataclass
class Plan:
    plan_id: int
    src: int
    dst: int
    move: bool
    hashes: list[BlockHash]
    generations: list[int]
    parents: list[BlockHash]
    state: PlanState = PlanState.PREPARING
    acked: set[int] = field(default_factory=set)  # ranks that finished the current phase
    src_blocks: list[int] = field(default_factory=list)
    dst_blocks: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    started: float = 0.0
    deadline: float = 0.0
    abort_reason: str = ""
    marked: list[BlockHash] = field(default_factory=list)  # hashes marked in flight on the destination
    keep: int = 0  # a move frees none of its first ``keep`` blocks (ancestors copied along)
    kind: str = "explicit"  # who asked: "explicit" (the API), "background", "foreground" or "pull"
    steps_s: float = 0.0  # the participants' steps its opener priced beside the copy (not the cost model's)
    phases: list[float] = field(default_factory=list)  # seconds from start to each phase's end (``PHASES``)
    sides: list[float] = field(default_factory=lambda: [0.0, 0.0])  # ... to the source's, destination's prepare
    held: list[float] = field(default_factory=lambda: [0.0, 0.0])  # ... the part its order waited on that worker
    pulled: bool = False  # the destination read the bytes itself: execute waits for it alone

    @property
    def num_moved(self) -> int:
        """Blocks the source gives up (at most: its finalize frees only unreferenced ones)."""
        return len(self.hashes) - self.keep if self.move else 0


class TransferCoordinator:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        send: Callable[[int, TransferOrder], None],
        cost_model: TransferCostModel | None = None,
        phase_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[Plan], None] | None = None,
        first_plan_id: int = 1,
        on_published: Callable[[Plan], None] | None = None,
    ) -> None:
        self.gbm = gbm
        self.on_end = on_end
        # Told when a plan's destination has published: its blocks serve requests from then on,
        # one round trip (the source's finalize) before the plan is DONE.
        self.on_published = on_published
        self.send = send
        self.cost_model = cost_model
        self.phase_timeout_s = phase_timeout_s
        self.clock = clock
        self.plans: dict[int, Plan] = {}
        self._incoming: dict[int, int] = {}  # rank -> blocks open plans bring it (``incoming``)
        self.ended: dict[int, PlanState] = {}
        # A restarted control process must not reuse the ids its predecessor's plans hold on
        # the workers, hence a caller-chosen (random) start.
        self._ids = itertools.count(first_plan_id)
        self.started = 0
        self.completed = 0
        self.aborted = 0
        self.blocks_copied = 0  # blocks of completed plans the source kept
        self.blocks_moved = 0  # blocks of completed moves the source gave up
        self.phase_times = PhaseTimes()  # where completed plans' time went, per kind

    def start(self, src: int, dst: int, hashes: list[BlockHash], generations: list[int], parents: list[BlockHash],
              move: bool = False, keep: int = 0, kind: str = "explicit", anchor: tuple[BlockHash, int] = (ROOT_HASH, 0),
              steps_s: float = 0.0) -> Plan:
        """Open a plan for the chain(s) ``hashes`` (parents before children; ``parents[i]`` is
        block i's parent hash) from ``src`` to ``dst``; a move frees the source's copies of all
        but the first ``keep`` blocks. ``anchor`` = (hash, generation) of the destination's
        cached block the chain continues, which the destination pins while the plan runs.
        ``steps_s``: the participants' steps its opener expects it to wait for, which the cost
        model's correction leaves out (it learns the copy, not the load)."""
        if not hashes or len(parents) != len(hashes) or len(generations) != len(hashes):
            raise ValueError(f"a plan needs one or more blocks, each with a parent and a generation; got "
                             f"{len(hashes)} hashes, {len(parents)} parents, {len(generations)} generations")
        if not 0 <= keep <= len(hashes):
            raise ValueError(f"keep={keep} for a plan of {len(hashes)} blocks")
        now = self.clock()
        plan = Plan(next(self._ids), src, dst, move, list(hashes), list(generations), list(parents),
                    started=now, deadline=now + self.phase_timeout_s, keep=keep, kind=kind, steps_s=steps_s)
        self.started += 1
        self.plans[plan.plan_id] = plan
        self._incoming[dst] = self._incoming.get(dst, 0) + len(plan.hashes)
        self.send(src, PrepareSource(plan.plan_id, plan.hashes, plan.generations))
        self.send(dst, PrepareDest(plan.plan_id, len(hashes), *anchor))
        return plan

    def on_ack(self, ack: PlanAnswer) -> None:
        """A worker finished (or failed) its order for one phase of a plan."""
        plan, rank = self.plans.get(ack.plan_id), ack.rank
        if plan is None or plan.state is not ack.phase or rank in plan.acked:
            return  # late, duplicate, or for a phase already passed
        if isinstance(ack, PhaseFailed):
            self.abort(plan.plan_id, f"rank {rank} failed {ack.phase_name}: {ack.error}")
            return
        if isinstance(ack, SourcePrepared) and rank == plan.src:
            plan.src_blocks, plan.token_ids = ack.block_ids, ack.token_ids
            plan.sides[0], plan.held[0] = self.clock() - plan.started, ack.held_s
        elif isinstance(ack, DestPrepared) and rank == plan.dst:
            if not self._mark_reserved(plan, ack):
                return
            plan.sides[1], plan.held[1] = self.clock() - plan.started, ack.held_s
        elif ack.phase is PlanState.PREPARING or not isinstance(ack, SUCCESS.get(ack.phase, ())):
            return  # an answer this rank's order cannot have
        elif isinstance(ack, Executed) and ack.pulled and rank == plan.dst:
            plan.pulled = True
        plan.acked.add(rank)
        if plan.acked >= self._expected(plan):
            self._advance(plan)

    def _mark_reserved(self, plan: Plan, ack: DestPrepared) -> bool:
        """Enter the destination's reserved blocks in the page table as not ready (routing skips
        them); abort the plan, and say so, if the destination already holds one of them."""
        plan.dst_blocks = ack.block_ids
        for h, block_id, generation in zip(plan.hashes, plan.dst_blocks, ack.generations):
            if not self.gbm.mark_in_flight(plan.dst, h, block_id, generation):
                self.abort(plan.plan_id, f"rank {plan.dst} already holds block {short(h)}")
                return False
            plan.marked.append(h)
        return True

    def _expected(self, plan: Plan) -> set[int]:
        if plan.state is PlanState.EXECUTING and plan.pulled:
            return {plan.dst}
        if plan.state in (PlanState.PREPARING, PlanState.EXECUTING):
            return {plan.src, plan.dst}
        return {plan.dst} if plan.state is PlanState.PUBLISHING else {plan.src}

    def _advance(self, plan: Plan) -> None:
        plan.acked = set()
        now = self.clock()
        plan.phases.append(now - plan.started)
        plan.deadline = now + self.phase_timeout_s
        if plan.state is PlanState.PREPARING:
            plan.state = PlanState.EXECUTING
            self.send(plan.src, ExecuteSend(plan.plan_id, plan.dst, plan.src_blocks))
            self.send(plan.dst, ExecuteRecv(plan.plan_id, plan.src, plan.dst_blocks, plan.src_blocks))
        elif plan.state is PlanState.EXECUTING:
            plan.state = PlanState.PUBLISHING
            self.send(plan.dst, Publish(plan.plan_id, plan.hashes, plan.parents, plan.token_ids))
        elif plan.state is PlanState.PUBLISHING:
            for h in plan.marked:  # the destination's own deltas now make the copies routable
                self.gbm.unmark_in_flight(plan.dst, h, published=True)
            plan.marked = []
            plan.state = PlanState.FINALIZING
            self.send(plan.src, Finalize(plan.plan_id, plan.move, plan.keep))
            if self.on_published is not None:
                self.on_published(plan)
        else:
            self.completed += 1
            self.blocks_moved += plan.num_moved
            self.blocks_copied += len(plan.hashes) - plan.num_moved
            self._end(plan, PlanState.DONE)
            self.phase_times.record(plan.kind, plan.phases, (plan.sides[0], plan.sides[1]),
                                    (plan.held[0], plan.held[1]))
            # Until the destination published: what a request waiting for the blocks waits for.
            # The source's finalize comes after (under a burst, one of its busy steps later).
            copy_s = plan.phases[PUBLISHED] - plan.steps_s
            if self.cost_model is not None and copy_s > 0:  # else the steps, over-predicted, hide the copy
                self.cost_model.observe(plan.src, plan.dst, len(plan.hashes), copy_s)

    def abort(self, plan_id: int, reason: str) -> None:
        """End a plan before DONE: both sides release what they hold; the source keeps its blocks.

        After the destination published, its copy is already good: the plan then
        simply ends (the source drops its pins, as a copy would)."""
        plan = self.plans.get(plan_id)
        if plan is None:
            return
        if self.gbm.ranks[plan.dst].alive:
            for h in plan.marked:
                self.gbm.unmark_in_flight(plan.dst, h, published=False)
        plan.abort_reason = reason
        for rank in (plan.src, plan.dst):
            self.send(rank, AbortPlan(plan_id))
        self.aborted += 1
        self._end(plan, PlanState.ABORTED)

    def tick(self) -> None:
        """Watchdog: abort every plan stuck in one phase past its deadline."""
        now = self.clock()
        for plan in [p for p in self.plans.values() if now > p.deadline]:
            self.abort(plan.plan_id, f"timed out in {plan.state.value}")

    def busy(self, a: int, b: int) -> bool:
        """Whether a plan is open between ranks ``a`` and ``b``, in either direction."""
        return any({p.src, p.dst} == {a, b} for p in self.plans.values())

    def incoming(self, rank: int) -> int:
        """Blocks that open plans bring to ``rank``. Counted until the plan ends, though the
        rank's own load report shows them once reserved: a brief overestimate of its use,
        never an underestimate."""
        return self._incoming.get(rank, 0)

    def room(self, rank: int) -> int:
        """Blocks a transfer may take on ``rank``, evicting cached blocks nobody uses if it must
        (the worker's allocator reclaims the coldest unreferenced leaves, never a block in use):
        free + reclaimable, less routing's reservations and what open plans bring."""
        return self.gbm.ranks[rank].blocks_available - self.incoming(rank)

    def free_blocks(self, rank: int) -> int:
        """Free blocks a transfer may take on ``rank`` without evicting anything: its reported
        free blocks less those routing reserved and those open plans bring."""
        info = self.gbm.ranks[rank]
        return info.load.blocks_free - info.reserved_blocks - self.incoming(rank)

    def rank_died(self, rank: int) -> None:
        for plan in [p for p in self.plans.values() if rank in (p.src, p.dst)]:
            self.abort(plan.plan_id, f"rank {rank} died in {plan.state.value}")

    def _end(self, plan: Plan, state: PlanState) -> None:
        plan.state = state
        del self.plans[plan.plan_id]
        self._incoming[plan.dst] -= len(plan.hashes)
        self.ended[plan.plan_id] = state
        if self.on_end is not None:
            self.on_end(plan)
