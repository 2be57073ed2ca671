"""A worker's cache report too large for its control link goes in parts (``worker.report_parts``),
and its control link's failures are told apart (``Worker.send_control``): applied in order,
the parts give the page table the whole report's state, at its version; a refused message
fails alone; a broken link that is not the control process's death ends the worker."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.protocol import WorkerToControl, LoadReport, WorkerDelta, WorkerSnapshot
from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot
from lmpool.worker.main import Worker
from lmpool.worker.report_parts import split_delta, split_snapshot
from lmpool_ipc import MessageTooLargeError, PeerDeadError, RingCorruptError

BLOCKS = 64


def h(i: int) -> bytes:
    return i.to_bytes(32, "big") if i else b""  # 0: the root


def chain(n: int, tokens: int = 0) -> list[BlockStored]:
    """``n`` blocks, each the child of the one before (parents first)."""
    return [BlockStored(h(i + 1), h(i), i, 1, tuple(range(tokens))) for i in range(n)]


def page_table(reports: list) -> GlobalBlockManager:
    gbm = GlobalBlockManager(1, 4)
    gbm.register_rank(0, 1, BLOCKS)
    for r in reports:
        if isinstance(r, KVSnapshot):
            gbm.apply_snapshot(0, 1, r)
        else:
            assert gbm.apply_delta(0, 1, r), "a part did not continue the one before"
    return gbm


def state(gbm: GlobalBlockManager) -> tuple:
    nxt = KVDelta(VERSION, VERSION + 1, [BlockStored(h(999), h(0), BLOCKS - 1, 1)])
    return dict(gbm.ranks[0].blocks), gbm.apply_delta(0, 1, nxt)  # the next real delta applies


VERSION = 100


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 45))
def test_a_snapshot_in_parts_gives_the_whole_snapshot_s_state(n, parts):
    whole = KVSnapshot(VERSION, chain(n))
    first, rest = split_snapshot(whole, parts)
    assert 1 + len(rest) <= max(1, parts) and all(d.events for d in rest)
    assert state(page_table([first, *rest])) == state(page_table([whole]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 45))
def test_a_delta_in_parts_gives_the_whole_delta_s_state(n, parts):
    before = KVSnapshot(VERSION - n, [])
    whole = KVDelta(VERSION - n, VERSION, list(chain(n)))
    split = split_delta(whole, parts)
    assert len(split) <= parts and [e for d in split for e in d.events] == whole.events
    assert state(page_table([before, *split])) == state(page_table([before, whole]))


def test_a_report_whose_versions_cannot_number_its_parts_stays_whole():
    snapshot = KVSnapshot(3, chain(10))  # fewer versions than blocks: no room to number deltas
    assert split_snapshot(snapshot, 4) == (snapshot, [])
    odd = KVDelta(0, 5, list(chain(2)))  # two events over five versions: not one per event
    assert split_delta(odd, 2) == [odd]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_delta(odd, 0)


class Link:
    """A control link that takes at most ``max_payload`` bytes a message, or raises ``fail``."""

    def __init__(self, max_payload: int, fail: Exception | None = None) -> None:
        self.max_payload = max_payload
        self.fail = fail
        self.sent: list = []
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def send_bytes(self, payload) -> None:
        self._check(len(payload))
        self.sent.append(msgspec.msgpack.decode(payload, type=WorkerToControl))

    async def send(self, msg) -> None:
        self._check(0)
        self.sent.append(msg)

    def _check(self, size: int) -> None:
        if self.fail is not None:
            raise self.fail
        if size > self.max_payload:
            raise MessageTooLargeError(f"{size} bytes")


def worker(link: Link) -> Worker:
    spec = types.SimpleNamespace(rank=0, epoch=1, transfer_rendezvous=None)
    core = types.SimpleNamespace(scheduler=types.SimpleNamespace(on_shortage=None),
                                 block_manager=types.SimpleNamespace(num_blocks=BLOCKS))
    w = Worker(spec, core, frontend=None)
    w.control, w.need_snapshot = link, False
    return w


def test_a_snapshot_over_the_link_s_limit_goes_in_parts_that_rebuild_it():
    whole = KVSnapshot(VERSION, chain(40, tokens=16))
    one = len(msgspec.msgpack.encode(WorkerSnapshot(0, 1, BLOCKS, whole, LoadReport())))
    link = Link(max_payload=one // 5)
    w = worker(link)
    asyncio.run(w.send_cache(whole, LoadReport(admitted=["a", "b"])))
    first, *rest = link.sent
    assert isinstance(first, WorkerSnapshot) and rest and all(isinstance(m, WorkerDelta) for m in rest)
    assert first.load.admitted == ["a", "b"] and all(m.load.admitted == [] for m in rest)  # once
    assert state(page_table([first.snapshot, *(m.delta for m in rest)])) == state(page_table([whole]))
    assert w.control is link and not w.need_snapshot


def test_a_report_no_split_fits_is_not_sent_and_a_snapshot_is_asked_for_again():
    link = Link(max_payload=64)  # under one block's message
    w = worker(link)
    asyncio.run(w.send_cache(KVSnapshot(VERSION, chain(8, tokens=16)), LoadReport()))
    assert link.sent == [] and w.need_snapshot and w.control is link


def test_a_refused_message_fails_alone_and_a_lost_control_process_detaches():
    link = Link(max_payload=1 << 20, fail=MessageTooLargeError("too large"))
    w = worker(link)
    assert asyncio.run(w.send_control(object())) is False
    assert w.control is link and w.fatal is None  # the link works on
    link.fail = PeerDeadError("control process gone")
    assert asyncio.run(w.send_control(object())) is False
    assert w.control is None and w.fatal is None and not w.stopping  # waits for its successor
    assert link.closed  # its rings unmapped: a pool that resets often would run out of descriptors


def test_a_broken_link_to_a_live_control_process_ends_the_worker():
    link = Link(max_payload=1 << 20, fail=RingCorruptError("bad frame"))
    w = worker(link)
    assert asyncio.run(w.send_control(object())) is False
    assert w.stopping and isinstance(w.fatal, RingCorruptError)  # ``run`` raises it: the process exits
