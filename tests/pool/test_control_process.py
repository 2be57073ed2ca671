"""The control process's handling of worker reports: stale snapshots are rejected, a gap in
deltas is answered with one ResyncRequest, and the following snapshot resynchronises."""

from __future__ import annotations

import asyncio

from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot
from lmpool.control.build import build_control_plane
from lmpool.control.plane import ControlPlane
from lmpool.protocol import LoadReport, ResyncRequest, RouteQuery, WorkerDelta, WorkerSnapshot
from lmpool.config.pool import PoolConfig
from lmpool.protocol.spec import ControlSpec
from lmpool_ipc import PeerDeadError


class FakeWorkerChannel:
    """Feeds scripted reports to ``read_worker`` and records what the control plane sends back."""

    def __init__(self, reports: list) -> None:
        self.reports = list(reports)
        self.sent: list = []

    async def recv(self):
        if not self.reports:
            raise PeerDeadError("script finished")
        return self.reports.pop(0)

    async def messages(self):
        while True:
            yield await self.recv()

    async def send(self, msg) -> None:
        self.sent.append(msg)


def stored(h: int, parent: int, block_id: int) -> BlockStored:
    return BlockStored(h, parent, block_id, 1)


def control() -> ControlPlane:
    spec = ControlSpec(pool=PoolConfig.from_options("unused", world_size=2, device="cpu", block_size=4),
                       frontend_end="unused", worker_ends=["unused", "unused"])
    return build_control_plane(spec)


LOAD = LoadReport(blocks_free=10)


def test_gap_triggers_one_resync_and_snapshot_recovers():
    plane = control()
    reports = [
        WorkerSnapshot(0, 1, 16, KVSnapshot(1, [stored(11, 0, 0)]), LOAD),
        WorkerDelta(0, 1, KVDelta(1, 2, [stored(12, 11, 1)]), LOAD),
        WorkerDelta(0, 1, KVDelta(5, 6, [stored(99, 98, 7)]), LOAD),  # versions 2..5 lost
        WorkerDelta(0, 1, KVDelta(6, 7, [stored(100, 99, 8)]), LOAD),  # still behind: no second ask
        WorkerSnapshot(0, 1, 16, KVSnapshot(7, [stored(11, 0, 0), stored(12, 11, 1), stored(13, 12, 2)]), LOAD),
        WorkerDelta(0, 1, KVDelta(7, 8, [stored(14, 13, 3)]), LOAD),
        WorkerSnapshot(0, 1, 16, KVSnapshot(3, [stored(11, 0, 0)]), LOAD),  # stale: older than 8
    ]
    channel = FakeWorkerChannel(reports)
    asyncio.run(plane.read_worker(0, channel))
    assert channel.sent == [ResyncRequest(0)]
    assert plane.resyncs == 1
    assert plane.stale_rejected == 1
    # After the script the channel "died": the rank is forgotten.
    assert plane.gbm.rank_state(0).alive is False


def test_a_report_that_cannot_be_applied_is_answered_with_a_resync():
    plane = control()
    reports = [
        WorkerSnapshot(0, 1, 16, KVSnapshot(1, [stored(11, 0, 0)]), LOAD),
        WorkerDelta(0, 1, KVDelta(1, 3, [stored(12, 11, 1)]), LOAD),  # two versions, one event
        WorkerSnapshot(0, 1, 16, KVSnapshot(3, [stored(11, 0, 0), stored(12, 11, 1)]), LOAD),
    ]
    channel = FakeWorkerChannel(reports)
    asyncio.run(plane.read_worker(0, channel))  # the reader outlives the bad report
    assert channel.sent == [ResyncRequest(0)]
    assert plane.gbm.snapshots_applied == 2


def test_routing_sees_the_resynced_chain():
    plane = control()
    reports = [
        WorkerSnapshot(1, 1, 16, KVSnapshot(0, []), LOAD),
        WorkerDelta(1, 1, KVDelta(3, 4, [stored(13, 12, 2)]), LOAD),  # gap
        WorkerSnapshot(1, 1, 16, KVSnapshot(4, [stored(11, 0, 0), stored(12, 11, 1), stored(13, 12, 2)]), LOAD),
    ]

    async def main():
        channel = FakeWorkerChannel(reports)
        channel.reports.append(None)  # keep the rank alive: block on an event instead of dying
        hold = asyncio.Event()

        async def recv():
            msg = channel.reports.pop(0)
            if msg is None:
                await hold.wait()
            return msg

        channel.recv = recv
        plane.gbm.register_rank(0, 1, 16)
        plane.gbm.apply_snapshot(0, 1, KVSnapshot(0, []))
        plane.gbm.update_load(0, 1, LOAD)
        task = asyncio.create_task(plane.read_worker(1, channel))
        while channel.reports:
            await asyncio.sleep(0)
        decision = await plane.handle(RouteQuery("r", [11, 12, 13, 14], 17, 4))
        task.cancel()
        return decision, channel.sent

    decision, sent = asyncio.run(main())
    assert sent == [ResyncRequest(1)]
    assert decision.rank == 1 and decision.matched_blocks == 3


def test_quiesce_starts_no_transfer_and_answers_once_the_open_plans_have_ended():
    """A reset's first step: placement starts no pass, a transfer asked for is refused, and the
    answer waits for the plan still open (here, until it aborts)."""
    from lmpool.protocol import Quiesce, TransferChain

    async def scenario():
        plane = control()
        plan = plane.coordinator.start(0, 1, [7], [1], [0])
        quiet = asyncio.create_task(plane.handle(Quiesce()))
        for _ in range(5):
            await asyncio.sleep(0)
        waited = not quiet.done()
        plane._place_now(fresh_only=False)
        idle = plane._slicing is None
        try:
            await plane.handle(TransferChain(0, 1, [7], False))
            refused = False
        except ValueError as e:
            refused = "resetting" in str(e)
        plane.coordinator.abort(plan.plan_id, "the test ends it")
        await quiet
        return waited, idle, refused

    assert asyncio.run(scenario()) == (True, True, True)
