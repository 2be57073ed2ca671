"""The control plane's questions to one worker (``ControlPlane.ask``): an explicit transfer of
blocks whose announcing delta has not reached the control plane yet asks the source for a
barrier first, and plans with what the answer brought. A source that holds nothing, dies
before answering or does not answer within a plan's phase timeout ends the request with a
reason instead of hanging it. A prompt without a complete block is refused before anything
is asked."""

from __future__ import annotations

import asyncio

import pytest

from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot
from lmpool.control.build import build_control_plane
from lmpool.protocol import (
    DigestAnswer,
    LoadReport,
    PhaseFailed,
    SyncAnswer,
    TransferChain,
    TransferOrder,
    WorkerDelta,
    WorkerQuery,
    WorkerSnapshot,
)
from lmpool.config.pool import PoolConfig
from lmpool.protocol.spec import ControlSpec
from lmpool_ipc import PeerDeadError

LOAD = LoadReport(blocks_free=10)
CHAIN = [11, 12]
DELTA = WorkerDelta(0, 1, KVDelta(0, 2, [BlockStored(11, 0, 0, 1), BlockStored(12, 11, 1, 1)]), LOAD)


class ScriptedWorker:
    """A worker's link as the control plane sees it: ``answer(order)`` lists the reports the
    worker sends back for each order; a report that is an exception ends the link with it."""

    def __init__(self, rank: int, answer) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait(WorkerSnapshot(rank, 1, 16, KVSnapshot(0, []), LOAD))
        self.orders: list[TransferOrder | WorkerQuery] = []
        self.answer = answer

    async def recv(self):
        msg = await self.inbox.get()
        if isinstance(msg, Exception):
            raise msg
        return msg

    async def messages(self):
        while True:
            yield await self.recv()

    async def send(self, msg) -> None:
        if isinstance(msg, TransferOrder | WorkerQuery):
            self.orders.append(msg)
            for report in self.answer(msg):
                self.inbox.put_nowait(report)


def refuse_plans(rank: int, order: TransferOrder | WorkerQuery) -> list:
    """Fail every plan phase at once, so that a started plan ends promptly."""
    if order.kind in ("prepare_source", "prepare_dest"):
        return [PhaseFailed(order.plan_id, rank, "preparing", "stopped by the test")]
    return []


async def transfer(source_answer, chain: list[int] = CHAIN,
                   phase_timeout_s: float | None = None) -> tuple[object, list[TransferOrder | WorkerQuery]]:
    spec = ControlSpec(pool=PoolConfig.from_options("unused", world_size=2, device="cpu", block_size=4),
                       frontend_end="unused", worker_ends=["unused", "unused"])
    plane = build_control_plane(spec)
    if phase_timeout_s is not None:
        plane.coordinator.phase_timeout_s = phase_timeout_s
    workers = [ScriptedWorker(0, source_answer), ScriptedWorker(1, lambda order: refuse_plans(1, order))]
    tasks = []
    for rank, worker in enumerate(workers):
        plane.workers[rank] = worker
        plane.outbox[rank] = asyncio.Queue()
        tasks += [asyncio.create_task(plane.read_worker(rank, worker)),
                  asyncio.create_task(plane.send_orders(rank, worker))]
    await asyncio.gather(*(plane.known[r].wait() for r in range(2)))
    try:
        result = await asyncio.wait_for(plane.handle(TransferChain(0, 1, chain)), 10)
    finally:
        for task in tasks:
            task.cancel()
    assert not plane.worker_queries  # every question is forgotten once answered
    return result, workers[0].orders


def test_a_transfer_waits_for_the_delta_the_source_sent_before_it():
    def source(order: TransferOrder | WorkerQuery) -> list:
        if order.kind == "sync":  # the delta was on its way: it arrives before the answer
            return [DELTA, SyncAnswer(order.query_id, 0)]
        return refuse_plans(0, order)

    result, orders = asyncio.run(transfer(source))
    assert [o.kind for o in orders[:2]] == ["sync", "prepare_source"]
    assert orders[1].hashes == CHAIN and orders[1].generations == [1, 1]
    assert result.state == "aborted" and "stopped by the test" in result.reason


def test_blocks_the_source_does_not_hold_end_the_transfer_after_one_question():
    def source(order: TransferOrder | WorkerQuery) -> list:
        if order.kind == "sync":
            return [SyncAnswer(order.query_id, 0)]
        return refuse_plans(0, order)

    result, orders = asyncio.run(transfer(source))
    assert [o.kind for o in orders] == ["sync"]
    assert result.state == "aborted" and result.reason == f"rank 0 does not hold block {CHAIN[0]:#x}"


def test_a_source_that_dies_before_answering_ends_the_transfer():
    def source(order: TransferOrder | WorkerQuery) -> list:
        return [PeerDeadError("killed")] if order.kind == "sync" else []

    result, orders = asyncio.run(transfer(source))
    assert [o.kind for o in orders] == ["sync"]
    assert result.state == "aborted" and result.reason == "rank 0 went down before it answered"


def test_an_answer_from_another_rank_or_a_late_one_is_ignored():
    def source(order: TransferOrder | WorkerQuery) -> list:
        if order.kind == "sync":
            return [SyncAnswer(order.query_id + 1, 0),  # no such question
                    SyncAnswer(order.query_id, 1),  # not from the rank asked
                    # another kind of question's answer with this id (one the control process
                    # this one replaced asked, late): not this question's answer
                    DigestAnswer(order.query_id, 0, ["stale"]),
                    DELTA, SyncAnswer(order.query_id, 0)]
        return refuse_plans(0, order)

    result, orders = asyncio.run(transfer(source))
    assert [o.kind for o in orders[:2]] == ["sync", "prepare_source"]
    assert "stopped by the test" in result.reason


def test_a_prompt_without_a_complete_block_is_refused_with_the_reason():
    def source(order: TransferOrder | WorkerQuery) -> list:
        raise AssertionError(f"nothing should be asked of the source, got {order.kind!r}")

    with pytest.raises(ValueError, match="no complete block of 4 tokens"):
        asyncio.run(transfer(source, chain=[]))


def test_a_source_that_never_answers_ends_the_transfer_within_a_phase_timeout():
    def source(order: TransferOrder | WorkerQuery) -> list:
        return []  # frozen: takes the question, never answers

    result, orders = asyncio.run(transfer(source, phase_timeout_s=0.2))  # the bound is the plans' own
    assert [o.kind for o in orders] == ["sync"]
    assert result.state == "aborted" and result.reason == "rank 0 did not answer a 'sync' within 0.2s"


def test_question_ids_start_where_a_replaced_control_process_would_not():
    spec = ControlSpec(pool=PoolConfig.from_options("unused", world_size=2, device="cpu", block_size=4),
                       frontend_end="unused", worker_ends=["unused", "unused"])
    firsts = {build_control_plane(spec)._query_ids for _ in range(4)}
    assert len(firsts) == 4  # random 48-bit starts: two equal ones would be a 6 in 2**48 event
