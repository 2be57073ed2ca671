"""The control process's transfer parts for route-time pulls and placement, in one event loop
without workers: a route that opens a pull is answered only once the pull has landed, one
whose destination dies meanwhile is routed again, and routes drive placement passes (one per
burst, run after the routes, never inside them)."""

from __future__ import annotations

import asyncio

import pytest

from lmpool.config.pool import PoolConfig
from lmpool.control.build import build_control_plane
from lmpool.control.plane import ControlPlane
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol import (
    Connect,
    DestPrepared,
    Executed,
    LoadReport,
    PhaseFailed,
    PlanState,
    Published,
    RouteQuery,
    SourcePrepared,
)
from lmpool.protocol.kv_events import BlockStored, KVSnapshot
from lmpool.protocol.spec import ControlSpec

BLOCK = 64
DOC = [bytes([i]) * 32 for i in range(1, 9)]  # block hashes: 32 bytes each


def control(mode: str) -> ControlPlane:
    # The engine model's prior step times: copying the document (about 2 ms on the uncalibrated
    # CPU link) beats recomputing its 512 tokens; the owner decodes past the bounded-load gate.
    pool = PoolConfig.from_options("unused", world_size=2, device="cpu", block_size=BLOCK, transfer_mode=mode)
    plane = build_control_plane(ControlSpec(pool=pool, frontend_end="unused", worker_ends=["unused", "unused"],
                                            transfers=True, kv_bytes_per_block=4096))
    parents = [ROOT_HASH] + DOC[:-1]
    for rank in (0, 1):
        plane.gbm.register_rank(rank, 1, 100)
        blocks = [BlockStored(h, p, i, 1) for i, (h, p) in enumerate(zip(DOC, parents))] if rank == 0 else []
        plane.gbm.apply_snapshot(rank, 1, KVSnapshot(1, blocks))
    plane.gbm.update_load(0, 1, LoadReport(num_running=12, decode_tokens_left=1200, context_tokens=12_000,
                                           blocks_free=90))  # the owner is decoding
    plane.gbm.update_load(1, 1, LoadReport(blocks_free=100))
    return plane


def query(i: int) -> RouteQuery:
    return RouteQuery(f"q{i}", DOC, len(DOC) * BLOCK + 1, 16)


async def turns(condition, what: str, limit: int = 100) -> None:
    """Yield loop turns until ``condition()`` holds (tasks run in turn); fail after ``limit``."""
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never happened")


async def opened(plane: ControlPlane, task: asyncio.Task):
    """The plan ``task``'s route opened, once the task has reached its wait."""
    await turns(lambda: plane.coordinator.plans or task.done(), "the route")
    assert not task.done(), task.result()
    (plan,) = plane.coordinator.plans.values()
    return plan


def test_a_pulled_route_is_answered_once_its_blocks_landed():
    async def main():
        plane = control("pull")
        task = asyncio.create_task(plane.route(query(0)))
        plan = await opened(plane, task)
        n = len(plan.hashes)
        plane.on_plan_answer(SourcePrepared(plan.plan_id, 0, list(range(n)), [[0] * BLOCK] * n))
        plane.on_plan_answer(DestPrepared(plan.plan_id, 1, list(range(50, 50 + n)), [1] * n))
        for rank in (0, 1):
            plane.on_plan_answer(Executed(plan.plan_id, rank))
        assert not task.done() and plan.state is PlanState.PUBLISHING
        plane.on_plan_answer(Published(plan.plan_id, 1))
        return await task, plane

    decision, plane = asyncio.run(main())
    assert decision.rank == 1 and decision.reason.startswith("pull r1<-r0") and decision.reason.endswith("pull landed")
    assert not plane.pull_waiters and not plane.policies.pulls.waiting


def connects(plane: ControlPlane) -> dict[int, list[Connect]]:
    """The ``Connect`` orders queued for each rank, taken off its queue (other orders dropped)."""
    out = {}
    for rank, queue in plane.outbox.items():
        orders = [queue.get_nowait() for _ in range(queue.qsize())]
        out[rank] = [o for o in orders if isinstance(o, Connect)]
    return out


@pytest.mark.parametrize("data_path", [True, False])
def test_a_pull_that_fails_on_its_data_path_has_its_pair_connected_again(data_path):
    """A pair whose data path broke (a gloo wait past its timeout) stays broken on its workers:
    without a new connection every later pull between them would abort. A plan failing on its
    data path makes the plane connect the pair again, under one fresh session for both ends,
    once the plan has ended; a failure of another kind leaves the connection alone."""
    async def main():
        plane = control("pull")
        for rank in (0, 1):
            plane.outbox[rank] = asyncio.Queue()  # live workers' order queues
        task = asyncio.create_task(plane.route(query(0)))
        plan = await opened(plane, task)
        n = len(plan.hashes)
        plane.on_plan_answer(SourcePrepared(plan.plan_id, 0, list(range(n)), [[0] * BLOCK] * n))
        plane.on_plan_answer(DestPrepared(plan.plan_id, 1, list(range(50, 50 + n)), [1] * n))
        assert connects(plane) == {0: [], 1: []}
        plane.on_plan_answer(PhaseFailed(plan.plan_id, 1, "executing", error_of(data_path), data_path=data_path))
        decision = await task
        return decision, plane, connects(plane)

    decision, plane, sent = asyncio.run(main())
    assert decision.rank == 1
    assert decision.reason.endswith(f"pull aborted: rank 1 failed executing: {error_of(data_path)}")
    assert not plane.coordinator.plans and not plane.paths.broken
    if data_path:
        (to_0,), (to_1,) = sent[0], sent[1]
        assert (to_0.peer, to_1.peer) == (1, 0) and to_0.session == to_1.session
    else:
        assert sent == {0: [], 1: []}
    assert plane.stats().transfers.reconnects == int(data_path)


def error_of(data_path: bool) -> str:
    return "TransportError: the connection of rank 1 to rank 0 is broken" if data_path else "StaleBlockError: gone"


def test_a_route_whose_destination_dies_mid_pull_is_routed_again():
    async def main():
        plane = control("pull")
        task = asyncio.create_task(plane.route(query(0)))
        await opened(plane, task)
        plane.coordinator.rank_died(1)
        plane.router.rank_down(1)
        return await task, plane

    decision, plane = asyncio.run(main())
    assert decision.rank == 0 and not plane.coordinator.plans and not plane.pull_waiters


def test_routes_drive_one_placement_pass_per_burst_after_them():
    async def main():
        plane = control("background")
        passes = []
        ran = asyncio.Event()

        def tick(budget_s, fresh_only):
            passes.append((plane.route_queries, fresh_only))
            ran.set()
            return True  # the pass is over

        plane.policies.tick = tick
        for i in range(5):  # a burst: no route yields to the loop
            await plane.route(query(i))
        assert passes == [], "a pass never runs inside a route"
        await asyncio.wait_for(ran.wait(), 60)  # (a guard against a hang, not a deadline)
        ran.clear()
        await plane.route(query(5))
        await asyncio.wait_for(ran.wait(), 60)
        return passes

    assert asyncio.run(main()) == [(5, True), (6, True)], "reactions, over the chains routed since the last pass"


def test_a_placement_pass_runs_in_slices_and_routes_run_between_them():
    async def main():
        plane = control("background")
        events = []
        done = asyncio.Event()

        async def route(i):
            await plane.route(query(i))
            events.append(f"route {i}")

        def tick(budget_s, fresh_only):
            assert budget_s == plane.spec.pool.transfer.transfer_policy.placement_slice_s
            events.append("slice")
            if len(events) == 1:
                asyncio.get_running_loop().create_task(route(0))  # arrives during the pass
            over = events.count("slice") == 3
            if over:
                done.set()
            return over

        plane.policies.tick = tick
        plane._place_now(fresh_only=False)
        await asyncio.wait_for(done.wait(), 60)  # (a guard against a hang, not a deadline)
        return events

    assert asyncio.run(main()) == ["slice", "route 0", "slice", "slice"]
