"""The control process's state and tasks on its one uvloop event loop: workers' reports applied
to the page table and their step timings to the engine model, the frontend's requests served
(routes, stats, explicit transfers, questions to a worker), transfer plans run, heartbeats
sent, the pool-state board published.
Background placement runs over every remembered chain each ``interval_s`` and over the newly
routed ones right after routes (``react``), in slices of ``placement_slice_s`` so that routes
run between them. With route-time pulls (``lmpool.control.transfers.pull``) a route may open
a copy plan for the request's prefix; that route's reply waits until the copy has landed or
aborted, never the routing of others. A route's bookkeeping (its reservation, pending prefix,
demand) runs once its reply is written (``Router.record``), so the route latency in ``stats``
is the decision's.

Invariants: every state change runs as a callback of the one loop, so the page table, router
and coordinator need no locks; KV bytes never pass through; a gap in a worker's deltas is
answered with one ``ResyncRequest`` and stale reports are rejected and counted; a question to a
rank that dies is answered with an error; the process exits when the frontend's link ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import time

import msgspec
import numpy as np

from lmpool.control.kv_events import pool_events as kv_pool_events
from lmpool.control.page_table.manager import GlobalBlockManager, StaleUpdateError
from lmpool.control.pricing.engine_model import EngineModel
from lmpool.control.route_latency import RouteLatency
from lmpool.control.routing.router import Router
from lmpool.control.transfers.coordinator import Plan, TransferCoordinator
from lmpool.control.transfers.data_paths import DataPaths
from lmpool.control.transfers.policies import TransferPolicies
from lmpool.engine.hashing import ROOT_HASH, short
from lmpool.protocol import (
    BlockDigests,
    ControlStats,
    CudaIpcExport,
    DigestAnswer,
    DigestQuery,
    DigestsReply,
    FrontendToControl,
    Heartbeat,
    PhaseFailed,
    PlanAnswer,
    PlanState,
    QueryAnswer,
    Quiesce,
    RankDown,
    RankUp,
    ReleaseRoute,
    ResyncRequest,
    RouteDecision,
    RouteQuery,
    ShortageReport,
    StatsQuery,
    StepTimings,
    SyncAnswer,
    SyncQuery,
    TransferChain,
    TransferResult,
    WaitRanks,
    WorkerDelta,
    WorkerQuery,
    WorkerSnapshot,
    WorkerToControl,
)
from lmpool.protocol.base import BlockHash
from lmpool.protocol.spec import ControlSpec
from lmpool.protocol.state_board import PUBLISH_INTERVAL_S, PoolState, RankRow, StateBoardWriter
from lmpool_ipc import Channel, IpcError, Responder

# The answer each question to a worker takes (an answer of another type with its id is a stale one).
ANSWERS: dict[type, type] = {DigestQuery: DigestAnswer, SyncQuery: SyncAnswer}

ROUTE_SAMPLES = 4096  # route latencies kept for the p50/p99 in stats
QUERY_TIMEOUT_S = 30.0  # a live worker answers at its next step boundary; a digest hashes blocks
log = logging.getLogger("lmpool.control")


class RankGoneError(RuntimeError):
    """A worker went down, or fell silent, before answering a question (``ControlPlane.ask``)."""


class Outbox(dict):
    """Per live rank, the queue of messages its sender task delivers (``rank -> asyncio.Queue``)."""

    def send(self, rank: int, message) -> None:
        """Queue a message for the rank's sender task (dropped for a rank that is gone)."""
        queue = self.get(rank)
        if queue is not None:
            queue.put_nowait(message)


class ControlPlane:
    """The control process's state and tasks; built by ``lmpool.control.build``."""

    def __init__(self, spec: ControlSpec, gbm: GlobalBlockManager, router: Router, model: EngineModel,
                 coordinator: TransferCoordinator, policies: TransferPolicies, outbox: Outbox) -> None:
        self.spec = spec
        self.gbm = gbm
        self.router = router
        self.model = model
        self.coordinator = coordinator
        self.policies = policies
        self.outbox = outbox
        self.workers: dict[int, Channel] = {}
        # A rank with a queue here is a live worker (its queue goes when it dies).
        self.paths = DataPaths(outbox.send, coordinator.busy, lambda rank: rank in outbox and gbm.ranks[rank].alive)
        self.resync_pending: set[int] = set()
        # Set once a rank's first snapshot is applied, or once it is known dead.
        self.known = [asyncio.Event() for _ in range(spec.pool.world_size)]
        self._placed_at = 0.0  # the latest placement pass, periodic or driven by a route
        self._reaction: asyncio.TimerHandle | None = None
        self._slicing: asyncio.Handle | None = None  # the next slice of the placement pass under way
        # Route replies held until the pull their request waits on has landed or aborted.
        self.pull_waiters: dict[str, asyncio.Future] = {}
        self.plan_waiters: dict[int, asyncio.Future] = {}
        # Once set (``quiesce``), no transfer starts; the waiter hears when the last open plan ends.
        self.quiesced = False
        self.settled: asyncio.Future | None = None
        # Questions to one worker (``WorkerQuery``): (rank, the answer's type, waiter) by the id
        # they carry. Ids start at random: a worker may still answer a question of the control
        # process this one replaced, whose ids started where this one's would.
        self.worker_queries: dict[int, tuple[int, type, asyncio.Future]] = {}
        self._query_ids = random.getrandbits(48)
        self.route_us = np.zeros(ROUTE_SAMPLES)
        self.route_latency = RouteLatency()
        self.route_queries = 0
        self.loop_ms: dict[int, dict[str, list[float]]] = {}  # rank -> its step loop's stages (``RankState``)
        self.resyncs = 0
        self.stale_rejected = 0
        self.published = 0
        # Tests: check the page table's invariants after every transfer ack, and every
        # routing decision against it (``verify``).
        self.check = os.environ.get("LMPOOL_CHECK_INVARIANTS") == "1"
        self.kv_events = kv_pool_events.NO_KV_EVENTS  # vLLM-format events, when configured (run)

    # ---- workers -----------------------------------------------------------------

    async def read_worker(self, rank: int, channel: Channel) -> None:
        try:
            async for msg in channel.messages():
                if isinstance(msg, PlanAnswer):
                    self.on_plan_answer(msg)
                    continue
                if isinstance(msg, QueryAnswer):
                    self.on_query_answer(msg)
                    continue
                if isinstance(msg, ShortageReport):
                    if not self.quiesced:  # quiesced: the worker evicts, as when a move is refused
                        self.policies.on_shortage(msg)
                    continue
                if isinstance(msg, StepTimings):
                    if msg.rank == rank and msg.epoch >= self.gbm.ranks[rank].epoch:
                        self.model.observe(msg)
                        self.loop_ms[rank] = msg.loop_ms or self.loop_ms.get(rank, {})
                    continue
                if isinstance(msg, CudaIpcExport):
                    if 0 <= msg.peer < self.spec.pool.world_size and msg.peer != rank:
                        self.send_to(msg.peer, msg)  # relayed unopened to the one peer it serves
                    continue
                try:
                    gap = self.apply(msg)
                except StaleUpdateError:
                    self.stale_rejected += 1
                    continue
                except ValueError:
                    # A report the page table cannot take (a worker's bug) must not end this
                    # reader, which would leave the rank routable on a view that never
                    # changes again: its snapshot replaces whatever was applied of it.
                    log.exception("rank %d sent a report that cannot be applied; asking for a snapshot", rank)
                    gap = True
                if self.check:
                    self.verify(self.gbm.check_invariants)
                if isinstance(msg, WorkerSnapshot):
                    self.resync_pending.discard(rank)
                    self.known[rank].set()
                elif gap and rank not in self.resync_pending:  # ask once per gap
                    self.resync_pending.add(rank)
                    self.resyncs += 1
                    await channel.send(ResyncRequest(rank))
        except IpcError:
            self.kv_events.rank_down(rank)
            self.coordinator.rank_died(rank)
            self.router.rank_down(rank)
            self.workers.pop(rank, None)
            self.outbox.pop(rank, None)  # orders for a dead rank have nowhere to go
            self.known[rank].set()
            for asked, _, waiter in self.worker_queries.values():
                if asked == rank and not waiter.done():
                    waiter.set_exception(RankGoneError(f"rank {rank} went down before it answered"))

    def apply(self, msg: Heartbeat | WorkerSnapshot | WorkerDelta) -> bool:
        """Apply one worker report; True when a gap means the rank must resend a snapshot."""
        if isinstance(msg, WorkerSnapshot):
            self.gbm.register_rank(msg.rank, msg.epoch, msg.num_blocks)
            self.gbm.apply_snapshot(msg.rank, msg.epoch, msg.snapshot)
            self.gbm.update_load(msg.rank, msg.epoch, msg.load)
            self.kv_events.snapshot(msg.rank, msg.snapshot)
            return False
        if isinstance(msg, WorkerDelta):
            applied = self.gbm.apply_delta(msg.rank, msg.epoch, msg.delta)
            if applied:
                self.kv_events.delta(msg.rank, msg.delta)
            self.gbm.update_load(msg.rank, msg.epoch, msg.load)
            return not applied
        if msg.load is not None:
            self.gbm.update_load(msg.rank, msg.epoch, msg.load)
        else:
            self.gbm.heartbeat(msg.rank, msg.epoch)
        return False

    # ---- transfers ---------------------------------------------------------------------

    def send_to(self, rank: int, message) -> None:
        self.outbox.send(rank, message)

    async def send_orders(self, rank: int, channel: Channel) -> None:
        queue = self.outbox[rank]
        while True:
            order = await queue.get()
            try:
                await channel.send(order)
            except IpcError:
                return  # the reader sees the death and aborts the rank's plans

    def verify(self, check, *args) -> None:
        """Run an invariant check (``LMPOOL_CHECK_INVARIANTS=1``); a violation ends this process
        at once, loudly, so that no test can miss it (the frontend counts a control restart)."""
        try:
            check(*args)
        except AssertionError as e:
            log.critical("control-plane invariant violated: %s", e, exc_info=True)
            logging.shutdown()
            os._exit(70)

    def on_query_answer(self, answer: QueryAnswer) -> None:
        asked = self.worker_queries.get(answer.query_id)
        if asked is None:
            return
        rank, answer_type, waiter = asked
        if rank == answer.rank and isinstance(answer, answer_type) and not waiter.done():  # ``ask`` forgets it
            waiter.set_result(answer)

    def on_plan_answer(self, ack: PlanAnswer) -> None:
        if isinstance(ack, PhaseFailed) and ack.data_path:
            plan = self.coordinator.plans.get(ack.plan_id)
            if plan is not None:
                self.paths.mark_broken(plan.src, plan.dst)
        self.coordinator.on_ack(ack)  # a failure ends the plan: ``plan_ended`` settles its pair
        if self.check:
            self.verify(self.gbm.check_invariants)
            if self.policies.pulls is not None:
                self.verify(self.policies.pulls.check_invariants)

    def plan_published(self, plan: Plan) -> None:
        """The coordinator saw a plan's destination publish: its blocks serve from now on."""
        self.policies.plan_published(plan)

    def pull_resolved(self, request_id: str, outcome: str) -> None:
        """A route-time pull landed or aborted: the route reply it held may go."""
        waiter = self.pull_waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def plan_ended(self, plan: Plan) -> None:
        """The coordinator ended a plan: tell the policies and whoever asked for it."""
        self.policies.plan_ended(plan)
        self.paths.settle()  # a broken pair waits for its last plan to end
        waiter = self.plan_waiters.pop(plan.plan_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(TransferResult(plan.plan_id, plan.state.value, plan.abort_reason,
                                             self.coordinator.clock() - plan.started))
        if self.settled is not None and not self.coordinator.plans and not self.settled.done():
            self.settled.set_result(None)

    async def quiesce(self) -> None:
        """Start no transfer from now on; return once every open plan has ended (each ends by its
        answers or, stuck, by the watchdog's deadline)."""
        self.quiesced = True  # a placement pass, under way or to come, stops at its next slice
        if self.coordinator.plans:
            self.settled = self.settled or asyncio.get_running_loop().create_future()
            await self.settled

    async def transfer_chain(self, request: TransferChain) -> TransferResult:
        if self.quiesced:
            raise ValueError("the pool is resetting: no transfer starts")
        for rank in (request.src, request.dst):
            if rank not in self.outbox:
                raise ValueError(f"rank {rank} is not a live rank of this pool")
        if request.src == request.dst:
            raise ValueError(f"a transfer needs two ranks, got {request.src} twice")
        if not request.block_hashes:
            raise ValueError("nothing to transfer: the prompt holds no complete block of "
                             f"{self.spec.pool.engine.block_size} tokens")
        generations, missing = self._generations(request.src, request.block_hashes)
        if missing is not None:
            # The caller may have seen the request that cached these blocks finish before
            # the source's delta announcing them reached this process: once the source has
            # answered a round trip, every delta it sent before is applied.
            try:
                await self.ask(request.src, SyncQuery, timeout_s=self.coordinator.phase_timeout_s)
            except RankGoneError as e:
                return TransferResult(0, PlanState.ABORTED.value, str(e))
            generations, missing = self._generations(request.src, request.block_hashes)
        if missing is not None:
            return TransferResult(0, PlanState.ABORTED.value,
                                  f"rank {request.src} does not hold block {short(missing)}")
        parents = [ROOT_HASH] + request.block_hashes[:-1]
        plan = self.coordinator.start(request.src, request.dst, request.block_hashes, generations, parents,
                                      move=request.move)
        waiter = asyncio.get_running_loop().create_future()
        self.plan_waiters[plan.plan_id] = waiter
        return await waiter

    def _generations(self, rank: int, block_hashes: list[BlockHash]) -> tuple[list[int], BlockHash | None]:
        """The generation of each block at ``rank`` up to the first hash it does not hold
        ready, and that hash (None: it holds them all)."""
        generations: list[int] = []
        for h in block_hashes:
            entry = next((e for e in self.gbm.entries(h) if e.rank == rank and e.ready), None)
            if entry is None:
                return generations, h
            generations.append(entry.generation)
        return generations, None

    async def ask(self, rank: int, query: type[WorkerQuery], *args, timeout_s: float = QUERY_TIMEOUT_S) -> QueryAnswer:
        """Ask ``rank`` a question (``query(query_id, *args)``); its answer. The answer follows
        on the worker's one FIFO link everything it sent before taking the question."""
        outbox = self.outbox.get(rank)
        if outbox is None:
            raise RankGoneError(f"rank {rank} is not a live rank of this pool")
        self._query_ids += 1
        query_id = self._query_ids
        waiter = asyncio.get_running_loop().create_future()
        self.worker_queries[query_id] = (rank, ANSWERS[query], waiter)
        outbox.put_nowait(query(query_id, *args))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise RankGoneError(f"rank {rank} did not answer a {query.kind!r} within {timeout_s}s") from None
        finally:
            self.worker_queries.pop(query_id, None)

    async def block_digests(self, request: BlockDigests) -> DigestsReply:
        if request.rank not in self.outbox:
            raise ValueError(f"rank {request.rank} is not a live rank of this pool")
        answer = await self.ask(request.rank, DigestQuery, request.block_hashes)
        assert isinstance(answer, DigestAnswer)  # ``ask`` takes only a DigestQuery's answer
        return DigestsReply(answer.digests)

    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.coordinator.tick()

    async def place(self) -> None:
        """Background placement: one bounded, synchronous pass per interval."""
        while True:
            await asyncio.sleep(self.spec.pool.transfer.transfer_policy.interval_s)
            self._place_now(fresh_only=False)

    def react(self) -> None:
        """Schedule a placement pass right after a route (at most one per ``react_interval_s``),
        so that a burst's demand is answered within milliseconds, not at the next periodic pass.
        The pass runs as its own callbacks: never on the route's path."""
        if self.policies.placement is None or self._reaction is not None or self._slicing is not None:
            return
        interval = self.spec.pool.transfer.transfer_policy.react_interval_s
        delay = max(0.0, self._placed_at + interval - time.monotonic())
        self._reaction = asyncio.get_running_loop().call_later(delay, self._place_now, True)

    def _place_now(self, fresh_only: bool) -> None:
        """Start a placement pass: over every remembered chain, or (a route's reaction) over
        those routed since the last pass began."""
        if self._reaction is not None:
            self._reaction.cancel()
            self._reaction = None
        if self._slicing is not None:
            return  # a pass is under way; it goes on
        self._placed_at = time.monotonic()
        self._place_slice(fresh_only)

    def _place_slice(self, fresh_only: bool = False) -> None:
        """One slice of the placement pass; the next is queued behind whatever is ready, so a
        route waits for one slice at most, never for a whole pass."""
        self._slicing = None
        if self.quiesced:
            self.policies.drop_pass()
            return
        try:
            over = self.policies.tick(self.spec.pool.transfer.transfer_policy.placement_slice_s, fresh_only)
        except Exception:  # a bug in a policy must not end placement, nor the control plane
            log.exception("background placement pass failed")
            self.policies.drop_pass()
            over = True
        if not over:
            self._slicing = asyncio.get_running_loop().call_soon(self._place_slice)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.spec.pool.heartbeat_interval)
            for rank, channel in list(self.workers.items()):
                try:
                    await channel.send(Heartbeat(rank, 0))
                except IpcError:
                    pass  # its reader sees the failure and marks the rank dead
            self.watch_silence()

    def watch_silence(self) -> None:
        """With ``hang_timeout`` set, a worker that has sent nothing for that long (every worker
        heartbeats) leaves routing until it reports again: its view here is frozen."""
        timeout = self.spec.pool.hang_timeout
        if timeout is None:
            return
        assert not isinstance(timeout, str)  # PoolConfig resolved "auto" to seconds or None
        for rank in self.gbm.mark_silent(timeout):
            log.warning("rank %d has reported nothing for over %g s: routed around until it does", rank, timeout)

    # ---- frontend requests -------------------------------------------------------

    async def handle(self, request: FrontendToControl):
        if isinstance(request, RouteQuery):
            return await self.route(request)
        if isinstance(request, ReleaseRoute):
            self.router.record()  # the last decided route, if it is this one, is reserved first
            self.gbm.release(request.request_id)
            return None
        if isinstance(request, RankDown):
            self.router.rank_down(request.rank)
            self.known[request.rank].set()
            return None
        if isinstance(request, WaitRanks):
            await asyncio.gather(*(self.known[r].wait() for r in request.ranks))
            return None
        if isinstance(request, RankUp):
            self.gbm.rank_up(request.rank, request.epoch)
            return None
        if isinstance(request, StatsQuery):
            return self.stats()
        if isinstance(request, Quiesce):
            await self.quiesce()
            return None
        if isinstance(request, TransferChain):
            return await self.transfer_chain(request)
        if isinstance(request, BlockDigests):
            return await self.block_digests(request)
        raise ValueError(f"unexpected request {type(request).__name__}")

    def route_once(self, request: RouteQuery) -> RouteDecision:
        start = time.perf_counter_ns()
        decision = self.router.decide(request)  # recorded once its reply is written (serve's after_reply)
        elapsed_ns = time.perf_counter_ns() - start
        self.route_us[self.route_queries % ROUTE_SAMPLES] = elapsed_ns / 1e3
        self.route_latency.observe(elapsed_ns / 1e9)
        if self.check:
            self.verify(self.gbm.check_route, request.block_hashes, decision.rank, decision.matched_blocks)
        self.route_queries += 1
        self.react()
        return decision

    async def route(self, request: RouteQuery) -> RouteDecision:
        """Route a request; one that waits on a route-time pull is answered once the pull has
        landed (its blocks are published on its rank) or aborted (it recomputes there). A
        destination that died meanwhile is routed around."""
        pulls = self.policies.pulls
        while True:
            decision = self.route_once(request)
            if pulls is None or not pulls.waits(request.request_id):
                return decision
            self.router.record()  # its reply waits on the pull (which this opens): its bookkeeping does not
            waiter = asyncio.get_running_loop().create_future()
            self.pull_waiters[request.request_id] = waiter
            if self.check:
                self.verify(pulls.check_invariants)
            outcome = await waiter
            decision = msgspec.structs.replace(decision, reason=f"{decision.reason}; pull {outcome}")
            if self.gbm.ranks[decision.rank].alive or not self.gbm.alive_mask:
                return decision

    def stats(self) -> ControlStats:
        n = min(self.route_queries, ROUTE_SAMPLES)
        samples = self.route_us[:n]
        return ControlStats(
            pid=os.getpid(),
            ranks=[msgspec.structs.replace(self.gbm.rank_state(r), step_fit=self.model.describe(r),
                                           loop_ms=self.loop_ms.get(r, {}))
                   for r in range(self.spec.pool.world_size)],
            route_queries=self.route_queries,
            route_p50_us=float(np.percentile(samples, 50)) if n else 0.0,
            route_p99_us=float(np.percentile(samples, 99)) if n else 0.0,
            resyncs=self.resyncs,
            stale_rejected=self.stale_rejected,
            transfers=msgspec.structs.replace(self.policies.stats(), reconnects=self.paths.reconnects),
        )

    def pool_state(self) -> PoolState:
        stats = self.stats()
        self.published += 1
        return PoolState(
            pool_id=self.spec.pool_id, owner_pid=self.spec.owner_pid, control_pid=stats.pid,
            started_at=self.spec.started_at, published=self.published, published_at=time.time(),
            monotonic=time.monotonic(), world_size=self.spec.pool.world_size,
            route_queries=stats.route_queries, route_p50_us=stats.route_p50_us,
            route_p99_us=stats.route_p99_us, route_latency_buckets=self.route_latency.cumulative(),
            route_latency_sum_s=self.route_latency.sum_s, transfers_committed=stats.transfers.plans_committed,
            blocks_transferred=stats.transfers.blocks_copied + stats.transfers.blocks_moved,
            ranks=[
                RankRow.from_state(s, self.spec.worker_pids[s.rank], len(self.gbm.ranks[s.rank].in_flight))
                for s in stats.ranks
            ],
        )

    async def publish_state(self) -> None:
        assert self.spec.board is not None  # started only with a board
        with StateBoardWriter(self.spec.board) as board:
            while True:
                board.publish(self.pool_state())
                await asyncio.sleep(PUBLISH_INTERVAL_S)

    async def run(self) -> None:
        # Everything made so far (modules, the spec, the page table's start) lives as long as
        # the process: keep it out of the collector's full passes, which would stall routing.
        # Collected first, as the workers and ``lmpool serve`` do: start-up garbage is not kept.
        gc.collect()
        gc.freeze()
        self.kv_events = kv_pool_events.from_config(self.spec.pool.kv_events, self.gbm)
        frontend: Channel[FrontendToControl] = Channel(self.spec.frontend_end, FrontendToControl)
        tasks = [asyncio.create_task(self.heartbeat())]
        if self.spec.board is not None:
            tasks.append(asyncio.create_task(self.publish_state()))
        for rank, end in enumerate(self.spec.worker_ends):
            if end is None:  # down before this control process started
                self.known[rank].set()
                continue
            channel: Channel[WorkerToControl] = Channel(end, WorkerToControl)
            self.workers[rank] = channel
            self.outbox[rank] = asyncio.Queue()
            tasks.append(asyncio.create_task(self.read_worker(rank, channel)))
            tasks.append(asyncio.create_task(self.send_orders(rank, channel)))
        if self.spec.transfers:
            self.paths.connect_all(self.workers)
            tasks.append(asyncio.create_task(self.watchdog()))
            if self.policies.background:
                tasks.append(asyncio.create_task(self.place()))
        try:
            await Responder(frontend, FrontendToControl, self.handle, after_reply=self.router.record).serve()
        except IpcError:
            pass  # the frontend died: nothing left to serve
        finally:
            for task in tasks:
                task.cancel()
            for channel in self.workers.values():
                channel.close()
            frontend.close()
            self.kv_events.close()
