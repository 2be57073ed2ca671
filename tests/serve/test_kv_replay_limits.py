"""The KV-event replay socket under abuse: a storm of replay requests, some never read, leaves
the loop its turns (a coroutine on the same loop runs between every few replies) while the
answers that are read are whole and right; one request gets at most the newest
``replay_max_batches`` batches, a snapshot at most that many batches; an oversized frame
disconnects its sender unread and the service goes on answering."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio
from waiting import until
from zmq.utils.monitor import recv_monitor_message

from lmpool.control.kv_events.publisher import MAX_INBOUND_BYTES, SENDS_PER_TURN, KVEventPublisher
from lmpool.protocol.vllm_kv_events import END_SEQ, SNAPSHOT_REQUEST, event_types

TYPES = event_types(True)
decode = msgspec.msgpack.Decoder(TYPES.batch).decode
FROM_0 = (0).to_bytes(8, "big")


@pytest.fixture
async def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def make_publisher():
    made = []

    def make(**kwargs) -> KVEventPublisher:
        made.append(KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", **kwargs).start())
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()


def publish(publisher: KVEventPublisher, batches: int, tokens: int = 4) -> None:
    """``batches`` batches, batch i (its seq) one block of hash 1000 + i on rank i % 2."""
    for i in range(batches):
        publisher.stored(i % 2, [1000 + i], None, [70_000 + i] * tokens, tokens)
        publisher.flush()


def dealer(ctx, publisher: KVEventPublisher, options: dict[int, int] | None = None) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    sock.connect(publisher.replay_endpoint)
    return sock


async def answer(sock) -> list[tuple[int, bytes]]:
    """One request's answer: its ``(seq, payload)`` replies up to the end marker."""
    out = []
    while (frames := await sock.recv_multipart())[1] != END_SEQ:
        _, seq, payload = frames
        out.append((int.from_bytes(seq, "big", signed=True), payload))
    return out


async def ask(sock, request: bytes) -> list[tuple[int, bytes]]:
    await sock.send_multipart((b"", request))
    return await asyncio.wait_for(answer(sock), 60)


def block_of(payload: bytes) -> int:
    [event] = decode(payload).events
    return event.block_hashes[0]


def assert_newest(replies, first: int, last: int) -> None:
    """The replies are batches ``first`` to ``last``, each its own payload."""
    assert [seq for seq, _ in replies] == list(range(first, last + 1))
    assert [block_of(payload) for _, payload in replies] == [1000 + seq for seq, _ in replies]


async def test_a_replay_storm_leaves_the_loop_its_turns(make_publisher, zctx):
    cap, batches = 40, 60
    publisher = make_publisher(buffer_steps=batches, replay_max_batches=cap)
    publish(publisher, batches, tokens=4096)  # ~20 KB a batch: unread answers overflow the kernel's buffers
    readers = [dealer(zctx, publisher) for _ in range(30)]
    unread = [dealer(zctx, publisher, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096}) for _ in range(4)]
    requests = len(readers) * 3 + len(unread) * 50

    seen, storm_over = [], asyncio.Event()

    async def probe() -> None:
        """Another coroutine on the loop: it notes how many replies went out at each of its turns."""
        while not storm_over.is_set():
            seen.append(publisher.replies_sent)
            await asyncio.sleep(0)

    async def reader(sock) -> list:
        answers = [await answer(sock)]  # its first request went out with the storm
        for _ in range(2):  # then one at a time, as vLLM's and Dynamo's consumers ask
            await sock.send_multipart((b"", FROM_0))
            answers.append(await answer(sock))
        return answers

    # The whole storm goes out before the publisher's task has a turn.
    for sock in unread:
        for _ in range(50):
            await sock.send_multipart((b"", FROM_0))
    for sock in readers:
        await sock.send_multipart((b"", FROM_0))
    watcher = asyncio.create_task(probe())
    answers = await asyncio.wait_for(asyncio.gather(*(reader(sock) for sock in readers)), 300)

    # Checked every loop turn, so that the probe's record ends as soon as the storm is in.
    await until(lambda: publisher.requests_received >= requests, "the publisher receiving every request",
                limit=300, interval=0)
    storm_over.set()
    await watcher

    for replies in (replies for three in answers for replies in three):
        assert_newest(replies, batches - cap, batches - 1)  # every answer read is whole and right
    # Between two turns of the probe the publisher had at most two turns, of SENDS_PER_TURN sends
    # each, though one answer alone is cap + 1 sends and hundreds were queued.
    steps = [b - a for a, b in zip(seen, seen[1:])]
    assert max(steps) <= 2 * SENDS_PER_TURN < cap + 1
    assert sum(0 < sent < seen[-1] for sent in seen) >= len(readers)  # the probe ran all through the storm
    assert publisher.replies_sent >= len(readers) * 3 * (cap + 1)
    # Clients that never read fill their queues, and their later requests are dropped unanswered.
    assert publisher.requests_dropped >= 1
    # The service still answers.
    assert_newest(await ask(dealer(zctx, publisher), FROM_0), batches - cap, batches - 1)


async def test_one_request_gets_at_most_the_newest_cap(make_publisher, zctx):
    publisher = make_publisher(buffer_steps=10, replay_max_batches=4)
    publish(publisher, 12)  # the buffer holds seqs 2..11
    sock = dealer(zctx, publisher)
    assert_newest(await ask(sock, FROM_0), 8, 11)  # older than the buffer and beyond the cap: the newest 4
    assert_newest(await ask(sock, (9).to_bytes(8, "big")), 9, 11)
    assert await ask(sock, (12).to_bytes(8, "big")) == []
    assert await ask(sock, (2**64 - 1).to_bytes(8, "big")) == []


@pytest.mark.parametrize(("cap", "blocks", "batches"), [(4, 2000, 3), (1000, 600, 4)])
async def test_a_snapshot_comes_in_at_most_cap_batches(make_publisher, zctx, cap, blocks, batches):
    """Rank 0 holds ``blocks`` blocks, rank 1 ten: cap 4 takes batches of ceil(2010 / 2) blocks
    (one per rank, two more), cap 1,000 batches of 256 (three for rank 0, one for rank 1)."""
    publisher = make_publisher(replay_max_batches=cap)
    publisher.stored(0, list(range(1, blocks + 1)), None, list(range(blocks * 2)), 2)
    publisher.stored(1, list(range(5001, 5011)), None, [7] * 20, 2)
    publisher.flush()
    sock = dealer(zctx, publisher)
    snapshot = await ask(sock, SNAPSHOT_REQUEST)
    assert len(snapshot) == batches <= cap
    assert {seq for seq, _ in snapshot} == {1}  # as of the last batch published
    assert snapshot_state(snapshot) == {0: list(range(1, blocks + 1)), 1: list(range(5001, 5011))}
    publisher.removed(0, [1])
    publisher.flush()
    snapshot = await ask(sock, SNAPSHOT_REQUEST)  # the state has moved on since the last one
    assert {seq for seq, _ in snapshot} == {2}
    assert snapshot_state(snapshot) == {0: list(range(2, blocks + 1)), 1: list(range(5001, 5011))}


def snapshot_state(snapshot) -> dict[int, list[int]]:
    """rank -> its blocks' hashes, in order, applying the snapshot's batches."""
    state: dict[int, list[int]] = {}
    for _, payload in snapshot:
        batch = decode(payload)
        blocks = state.setdefault(batch.data_parallel_rank, [])
        events = batch.events
        if isinstance(events[0], TYPES.cleared):
            blocks.clear()
            events = events[1:]
        blocks.extend(e.block_hashes[0] for e in events)
    return state


async def test_an_oversized_frame_disconnects_its_sender_unread(make_publisher, zctx):
    publisher = make_publisher()
    publish(publisher, 3)
    assert publisher._replay.getsockopt(zmq.MAXMSGSIZE) == MAX_INBOUND_BYTES
    assert publisher._pub.getsockopt(zmq.MAXMSGSIZE) == MAX_INBOUND_BYTES  # subscriptions (no topic)
    big = dealer(zctx, publisher)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    await big.send_multipart((b"", b"x" * (4 << 20)))
    event = await asyncio.wait_for(recv_monitor_message(monitor), 60)
    assert event["event"] == zmq.EVENT_DISCONNECTED  # the publisher hung up on it
    big.disable_monitor()
    assert_newest(await ask(dealer(zctx, publisher), FROM_0), 0, 2)
    assert publisher.requests_received == 1  # the oversized one never reached the service
