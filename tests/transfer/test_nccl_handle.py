"""The NCCL transport's handle without a GPU (``lmpool/dataplane/nccl.py``): completion seen
through its event orders the caller's stream after it; a broken pair fails every operation
not yet seen complete, even one whose event fired (an abort ends NCCL's kernels early); a
communicator's background error aborts the whole pair, asked at most once per
``ERROR_CHECK_S``; a wait that expires aborts the pair. Fakes stand in for CUDA events,
streams and NCCL communicators. An abort gives every lane's stream back (``streams``), once, and ends a lane the connect
thread adds after it."""

from __future__ import annotations

import pytest
import torch

from lmpool.dataplane import nccl
from lmpool.dataplane.nccl import ERROR_CHECK_S, NcclHandle, _NcclPair
from lmpool.dataplane.transport import TransferTimeout, TransportError


class FakeEvent:
    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired


class FakeComm:
    def __init__(self) -> None:
        self.error: str | None = None
        self.asked = 0
        self.aborted = False

    def async_error(self) -> str | None:
        self.asked += 1
        return self.error

    def abort(self) -> None:
        self.aborted = True


class FakeLane:
    def __init__(self) -> None:
        self.comm = FakeComm()
        self.stream = object()  # the lane's own stream: only given back


class FakeStream:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def world(monkeypatch):
    """A pair of two lanes per direction, a caller's stream and a clock the test moves."""
    stream = FakeStream()
    clock = [100.0]
    monkeypatch.setattr(nccl.torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(nccl.time, "monotonic", lambda: clock[0])
    released = []
    monkeypatch.setattr(nccl.streams, "release", released.append)
    pair = _NcclPair(peer=1, session=1)
    pair.outgoing = [FakeLane(), FakeLane()]
    pair.incoming = [FakeLane(), FakeLane()]
    pair.released = released
    return pair, stream, clock


def handle(pair: _NcclPair, lane: FakeLane | None = None) -> tuple[NcclHandle, FakeEvent]:
    event = FakeEvent()
    return NcclHandle("receive of 8 bytes", event, torch.zeros(2), lane or pair.incoming[0], pair), event


def test_a_completed_operation_orders_the_callers_stream_after_it(world):
    pair, stream, _ = world
    h, event = handle(pair)
    assert not h.done()
    event.fired = True
    assert h.done() and h.done()
    assert stream.waited == [event]  # once, when first seen complete
    h.wait(0)


def test_a_broken_pair_fails_an_operation_even_if_its_event_fired(world):
    pair, stream, _ = world
    h, event = handle(pair)
    pair.abort("peer gone")
    event.fired = True  # the abort ended NCCL's kernel early: the bytes are not all there
    assert h.done()
    with pytest.raises(TransportError, match="peer gone"):
        h.wait(0)
    assert stream.waited == []
    lanes = (*pair.outgoing, *pair.incoming)
    assert all(lane.comm.aborted for lane in lanes)
    assert pair.released == [lane.stream for lane in lanes]  # each lane's stream given back, once
    pair.abort("again")
    assert len(pair.released) == len(lanes)


def test_a_background_error_aborts_the_pair_asked_at_most_once_per_interval(world):
    pair, _, clock = world
    h, _ = handle(pair)
    lane = pair.incoming[0]
    for _ in range(50):  # a caller spinning within one interval asks nothing
        assert not h.done()
    assert lane.comm.asked == 0
    clock[0] += ERROR_CHECK_S
    assert not h.done() and lane.comm.asked == 1
    lane.comm.error = "remote process exited or there was a network error"
    assert not h.done() and lane.comm.asked == 1  # the next question waits for the next interval
    clock[0] += ERROR_CHECK_S
    assert h.done()
    with pytest.raises(TransportError, match="network error"):
        h.wait(0)
    assert pair.broken is not None and all(l.comm.aborted for l in (*pair.outgoing, *pair.incoming))
    other, _ = handle(pair, pair.outgoing[1])  # every other operation of the pair fails too
    assert other.done()


def test_a_wait_that_expires_aborts_the_pair(world):
    pair, _, _ = world
    h, _ = handle(pair)
    with pytest.raises(TransferTimeout, match="did not complete within 0"):
        h.wait(0)
    assert pair.broken is not None and "did not complete" in pair.broken
    assert all(lane.comm.aborted for lane in (*pair.outgoing, *pair.incoming))


def test_a_lane_made_after_the_pair_broke_is_ended_at_once(world):
    """The connect thread may finish a communicator after the pair was aborted (a new session
    replaced it): that lane is aborted and its stream given back when added, and the lanes
    added before are ended by the abort itself, each once."""
    pair, _, _ = world
    before = len(pair.outgoing) + len(pair.incoming)
    pair.abort("replaced by session 2")
    assert len(pair.released) == before
    late = FakeLane()
    pair.add(late, outgoing=True)
    assert late.comm.aborted and pair.released[-1] is late.stream and len(pair.released) == before + 1
    fresh = _NcclPair(peer=1, session=2)
    early = FakeLane()
    fresh.add(early, outgoing=False)
    assert not early.comm.aborted and fresh.incoming == [early]
