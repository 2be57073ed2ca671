"""A worker serves its links while a launched step runs (``Worker.while_stepping``): an order
arriving mid-step is answered before the step's tokens are read back, not after, and a request
arriving mid-step is read into the inbox then, with or without transfers. A step the device has
finished is read back before the next launch, its tokens sent first."""

from __future__ import annotations

import asyncio
from array import array

import pytest

from lmpool.config.pool import PoolConfig
from lmpool.engine.core import EngineCore
from lmpool.protocol import AddRequest, StepOutputs
from lmpool.protocol.frontend_worker import pack_ids
from lmpool.protocol.spec import WorkerSpec
from lmpool.sampling_params import SamplingParams
from lmpool.worker.main import Worker

POLLS = 10_000  # a bound on the fake step's polls, so a worker that never answers fails, not hangs


class Orders:
    """The executor's surface the step loop uses: orders in, answers out."""

    def __init__(self) -> None:
        self.orders: list[str] = []

    @property
    def busy(self) -> bool:
        return bool(self.orders)

    def progress(self) -> list[str]:
        answers, self.orders = [f"answer to {o}" for o in self.orders], []
        return answers


class DeviceStep:
    """A step the device finishes only once ``done()`` holds (or after ``POLLS`` polls)."""

    def __init__(self, done) -> None:
        self.done = done
        self.polls = 0

    def ready(self) -> bool:
        self.polls += 1
        return self.done() or self.polls >= POLLS


@pytest.fixture
def worker(tiny_model) -> Worker:
    pool = PoolConfig.from_options(tiny_model, world_size=1, num_kv_blocks=16)
    spec = WorkerSpec(rank=0, epoch=1, frontend_end="unused", control_end="unused", pool=pool)
    return Worker(spec, EngineCore(pool.engine_of(0)), frontend=None)


async def test_an_order_arriving_during_a_step_is_answered_before_the_step_ends(worker):
    orders = worker.transfers = Orders()
    sent: list = []

    async def send_control(msg, encoded: bool = False) -> bool:
        sent.append(msg)
        return True

    worker.send_control = send_control
    step = DeviceStep(lambda: bool(sent))  # done once the worker has answered

    async def reader() -> None:  # the control link's reader, delivering while the step runs
        await asyncio.sleep(0)
        orders.orders.append("prepare")

    delivery = asyncio.create_task(reader())
    await worker.while_stepping(step)
    await delivery
    assert sent == ["answer to prepare"]
    assert step.polls < POLLS  # the step ended because the answer went, not at the bound


async def test_a_finished_step_is_not_polled_again(worker):
    worker.transfers = Orders()
    step = DeviceStep(lambda: True)  # ready at once
    await worker.while_stepping(step)
    assert step.polls == 1


@pytest.mark.parametrize("transfers", [False, True])
async def test_a_request_arriving_during_a_step_is_read_before_the_step_ends(worker, transfers):
    """Without transfers too: a step loop that blocked on the device instead would leave the
    frontend's ring unread for the whole step, and its sends waiting once the ring is full."""
    worker.transfers = Orders() if transfers else None
    step = DeviceStep(lambda: bool(worker.inbox))  # done once the request was read

    async def reader() -> None:  # the frontend link's reader, delivering while the step runs
        await asyncio.sleep(0)
        worker.inbox.append("a request")

    delivery = asyncio.create_task(reader())
    await worker.while_stepping(step)
    assert worker.inbox == ["a request"]  # read while the step ran: it returns only once the step is done
    assert 0 < step.polls < POLLS  # the step ended because the request was read, not at the bound
    await delivery


async def test_a_step_the_device_has_finished_sends_its_tokens_before_the_next_launch(worker, monkeypatch):
    """The step loop of an overlapped engine whose steps finish within their launch (a CPU's): every
    launch finds the step before it read back, and each token reaches the user process before the
    launch of the step after the one that made it (``EngineCore.read_finished``)."""
    events: list = []

    class Frontend:
        async def send(self, msg) -> None:
            assert isinstance(msg, StepOutputs)
            events.extend(("token", d.finished) for d in msg.outputs)
            worker.stopping = any(d.finished for d in msg.outputs)

    async def quiet() -> None:  # the links' readers and the heartbeat: nothing arrives
        await asyncio.Event().wait()

    core = worker.core
    begin = core.begin_step

    def launch():
        read = core.in_flight is None
        step = begin()
        if step.batch.seqs:  # (the step after the last token's launches nothing)
            events.append(("launch", read))
        return step

    worker.frontend = Frontend()
    monkeypatch.setattr(worker, "read_frontend", quiet)
    monkeypatch.setattr(worker, "heartbeat", quiet)
    monkeypatch.setattr(worker, "attach_control", lambda end: None)
    monkeypatch.setattr(core, "begin_step", launch)
    assert core.config.async_scheduling
    worker.inbox.append(AddRequest("a", pack_ids(array("q", range(1, 20))), SamplingParams(temperature=0, max_tokens=3),
                                   [], []))
    await asyncio.wait_for(worker.run(), 60)  # a loop that lost the last token would wait for it forever
    assert events == [("launch", True), ("token", False), ("launch", True), ("token", False),
                      ("launch", True), ("token", True)]
