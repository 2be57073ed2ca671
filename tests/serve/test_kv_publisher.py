"""The KV-event publisher on its own, read by real ZMQ clients: a SUB socket sees
``[topic, seq, msgpack batch]`` in vLLM's layout, a DEALER replays the buffered batches from a
sequence number and asks for a snapshot of the current state."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio
from waiting import until

from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVSnapshot
from lmpool.protocol.vllm_kv_events import event_types, external_block_hash
from lmpool.control.kv_events.pool_events import PoolKVEvents
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.engine.hashing import ROOT_HASH
from lmpool.control.kv_events.publisher import KVEventPublisher
from lmpool.protocol.vllm_kv_events import END_SEQ, SNAPSHOT_REQUEST

BLOCK = 4


@pytest.fixture
async def wired():
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv", buffer_steps=3).start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    # A SUB socket misses what is published before its subscription lands: publish probes
    # until one arrives (a state to reach), then start from a clean slate.
    async def probe_heard() -> bool:
        publisher.cleared(99)
        publisher.flush()
        return bool(await sub.poll(50))

    # No pause between probes: each waits 50 ms for its own arrival.
    await until(probe_heard, "the subscription to reach the publisher", limit=30, interval=0)
    while await sub.poll(50):
        await sub.recv_multipart()
    yield publisher, sub, dealer
    sub.close(linger=0)
    dealer.close(linger=0)
    ctx.term()
    publisher.close()


decoder = msgspec.msgpack.Decoder(event_types(True).batch)


def events_of(payload: bytes) -> tuple[int | None, list]:
    batch = msgspec.msgpack.decode(payload)  # plain msgpack: the wire layout itself
    return batch[2] if len(batch) > 2 else None, batch[1]


async def replay(dealer, request: bytes) -> list[tuple[int, bytes]]:
    await dealer.send_multipart((b"", request))
    out = []
    while True:
        _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 30)
        if seq == END_SEQ:
            return out
        out.append((int.from_bytes(seq, "big", signed=True), payload))


async def test_batches_in_vllm_layout_with_seq_and_replay(wired):
    publisher, sub, dealer = wired
    publisher.stored(0, [11, 12], None, list(range(8)), BLOCK)
    publisher.flush()
    publisher.stored(1, [21], 11, [9, 9, 9, 9], BLOCK)
    publisher.removed(0, [12])
    publisher.flush()
    frames = [await asyncio.wait_for(sub.recv_multipart(), 30) for _ in range(3)]
    assert [f[0] for f in frames] == [b"kv"] * 3
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == sorted(seqs) and seqs[1:] == [seqs[0] + 1, seqs[0] + 2]
    rank, events = events_of(frames[0][2])
    assert rank == 0 and events == [["BlockStored", [11, 12], None, list(range(8)), BLOCK, None, "GPU", None]]
    ranks = {events_of(f[2])[0]: events_of(f[2])[1] for f in frames[1:]}
    assert ranks == {1: [["BlockStored", [21], 11, [9] * 4, BLOCK, None, "GPU", None]],
                     0: [["BlockRemoved", [12], "GPU"]]}
    # Replay from the second batch: the buffer (3 batches) still holds both.
    replayed = await replay(dealer, seqs[1].to_bytes(8, "big"))
    assert [(s, p) for s, p in replayed] == [(s, f[2]) for s, f in zip(seqs[1:], frames[1:])]


async def test_snapshot_is_the_current_state(wired):
    publisher, sub, dealer = wired
    publisher.stored(0, [11, 12, 13], None, list(range(12)), BLOCK)
    publisher.removed(0, [13])
    publisher.stored(1, [21], None, [5] * 4, BLOCK)
    publisher.flush()
    publisher.cleared(1)
    publisher.flush()
    last = [await asyncio.wait_for(sub.recv_multipart(), 30) for _ in range(3)][-1]
    snap = await replay(dealer, SNAPSHOT_REQUEST)
    assert {seq for seq, _ in snap} == {int.from_bytes(last[1], "big")}  # as of the last batch
    batches = {b.data_parallel_rank: b.events for b in (decoder.decode(p) for _, p in snap)}
    assert [type(e).__name__ for e in batches[0]] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in batches[0][1:]] == \
        [([11], None, [0, 1, 2, 3]), ([12], 11, [4, 5, 6, 7])]
    # A cleared rank is cleared in the snapshot too: a consumer that missed the event (it held
    # rank 1's block) drops it. The fixture's probes cleared rank 99.
    assert sorted(batches) == [0, 1, 99]
    assert [type(e).__name__ for e in batches[1]] == ["AllBlocksCleared"]


async def test_a_bad_replay_request_gets_only_the_end_marker(wired):
    _, _, dealer = wired
    assert await replay(dealer, b"what") == []


class Recorder:
    """A publisher's calls, and what it announced (``KVEventPublisher.announced``'s record)."""

    def __init__(self) -> None:
        self.calls = []
        self.held: dict[int, set] = {}

    def announced(self, rank, block_hash) -> bool:
        return block_hash in self.held.get(rank, ())

    def stored(self, rank, block_hashes, *rest) -> None:
        self.calls.append(("stored", rank, block_hashes, *rest))
        self.held.setdefault(rank, set()).update(block_hashes)

    def removed(self, rank, block_hashes) -> None:
        self.calls.append(("removed", rank, block_hashes))
        self.held.get(rank, set()).difference_update(block_hashes)

    def cleared(self, rank) -> None:
        self.calls.append(("cleared", rank))
        self.held[rank] = set()

    def flush(self) -> None:
        self.calls.append(("flush",))


class Reported:
    """The page table and its events, as the control process drives them: each report applied
    to the table, then published from it."""

    def __init__(self, **options) -> None:
        self.table = GlobalBlockManager(1, BLOCK)
        self.table.register_rank(0, 1, 64)
        self.recorder = Recorder()
        self.events = PoolKVEvents(self.recorder, self.table, **options)

    def snapshot(self, snapshot: KVSnapshot) -> None:
        self.table.apply_snapshot(0, 1, snapshot)
        self.events.snapshot(0, snapshot)

    def delta(self, delta: KVDelta) -> None:
        assert self.table.apply_delta(0, 1, delta)
        self.events.delta(0, delta)


def test_pool_reports_become_chained_events():
    """The adapter from the page table's reports: chains merge, removals of another copy (one
    the table does not hold) are dropped (whole hashes passed through, as ``int_hashes=False``
    sends them)."""
    reported = Reported(int_hashes=False)
    reported.snapshot(KVSnapshot(2, [BlockStored(1, ROOT_HASH, 0, 1, (1, 2, 3, 4)),
                                     BlockStored(2, 1, 1, 1, (5, 6, 7, 8))]))
    reported.delta(KVDelta(2, 6, [BlockStored(3, 2, 2, 1, (9,) * 4), BlockRemoved(1, 0, 9),  # another copy
                                  BlockRemoved(3, 2, 1), BlockStored(7, ROOT_HASH, 3, 1, (0,) * 4)]))
    reported.events.rank_down(0)
    assert reported.recorder.calls == [
        ("cleared", 0), ("stored", 0, [1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK), ("flush",),
        ("stored", 0, [3], 2, [9] * 4, BLOCK), ("removed", 0, [3]), ("stored", 0, [7], None, [0] * 4, BLOCK),
        ("flush",), ("cleared", 0), ("flush",),
    ]


def test_a_newer_copy_of_an_announced_block_is_not_news_nor_is_the_old_copy_s_removal():
    """A block stored again (a newer copy) is announced once; the removal of its old copy, which
    the table no longer holds as that copy, publishes nothing; the last copy's removal does."""
    reported = Reported(int_hashes=False)
    reported.snapshot(KVSnapshot(2, [BlockStored(1, ROOT_HASH, 0, 1, (1, 2, 3, 4))]))
    reported.delta(KVDelta(2, 4, [BlockStored(1, ROOT_HASH, 5, 2, (1, 2, 3, 4)), BlockRemoved(1, 0, 1)]))
    reported.delta(KVDelta(4, 5, [BlockRemoved(1, 5, 2)]))
    assert reported.recorder.calls == [
        ("cleared", 0), ("stored", 0, [1], None, [1, 2, 3, 4], BLOCK), ("flush",), ("flush",),
        ("removed", 0, [1]), ("flush",),
    ]


def test_hashes_go_out_as_vllm_default_integers():
    """By default a 32-byte hash is published as vLLM publishes its own: the digest's low 64 bits,
    an unsigned integer (the parent too); the removal of that copy names the same integer."""
    low = [2**63, 2**63 + 1]  # above int64: unsigned on the wire
    digest = [bytes([i + 1]) * 24 + low[i].to_bytes(8, "big") for i in range(2)]
    reported = Reported()
    recorder = reported.recorder
    reported.snapshot(KVSnapshot(2, [BlockStored(digest[0], ROOT_HASH, 0, 1, (1, 2, 3, 4)),
                                     BlockStored(digest[1], digest[0], 1, 1, (5, 6, 7, 8))]))
    reported.delta(KVDelta(2, 4, [BlockStored(b"\x07" * 32, digest[1], 2, 1, (9,) * 4), BlockRemoved(digest[1], 1, 1)]))
    assert external_block_hash(digest[0]) == low[0] and external_block_hash(b"\xff" * 32) == 2**64 - 1
    assert recorder.calls == [
        ("cleared", 0), ("stored", 0, low, None, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK), ("flush",),
        ("stored", 0, [external_block_hash(b"\x07" * 32)], low[1], [9] * 4, BLOCK), ("removed", 0, [low[1]]),
        ("flush",),
    ]
