"""``PoolEventFeed``: the pool's KV-event publisher, read in the serving process, in one loop.

The feed reads the publisher's full state when it starts hearing it (what it missed before its
subscription took is there), and again when the publisher restarts (a control process replaced:
its numbers begin again): the host then holds the new publisher's blocks only."""

from __future__ import annotations

import asyncio

import msgspec
from waiting import until

from lmpool.control.kv_events.publisher import KVEventPublisher
from lmpool.frontend.grpc.event_feed import PoolEventFeed
from lmpool.protocol.vllm_kv_events import event_types

SIZE = 2


def held(feed: PoolEventFeed) -> set:
    return {h for event in feed.view.snapshot().events[1:] for h in event.block_hashes}


async def publish_until(feed: PoolEventFeed, publisher: KVEventPublisher, condition) -> None:
    """Publish a no-op batch (a removal of a block no rank holds) until ``condition()`` holds:
    a subscription takes a moment to reach a new publisher, and what it publishes before that
    is never heard. Failing after two minutes of them: the feed had every chance to hear one."""

    def reached() -> bool:
        if condition():
            return True
        publisher.removed(7, [999])
        publisher.flush()
        return False

    await until(reached, "the feed to reach the state asked for", limit=120, interval=0.01,
                show=lambda: f"it holds {held(feed)}")


async def test_the_feed_reads_the_state_and_follows_a_restarted_publisher(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    feed = PoolEventFeed(endpoint, replay)
    publisher = KVEventPublisher(endpoint, replay).start()
    try:
        feed.start()
        publisher.stored(0, [1, 2], None, [10, 11, 20, 21], SIZE)  # before the feed hears anything
        publisher.flush()
        await publish_until(feed, publisher, lambda: held(feed) == {1, 2})
        publisher.stored(1, [3], 2, [30, 31], SIZE)
        publisher.flush()
        await publish_until(feed, publisher, lambda: held(feed) == {1, 2, 3})
        first_resyncs = feed.resyncs

        publisher.close()  # the control process is replaced: a new publisher, numbered from 0
        publisher = KVEventPublisher(endpoint, replay).start()
        publisher.stored(0, [4], None, [40, 41], SIZE)
        publisher.flush()
        await publish_until(feed, publisher, lambda: held(feed) == {4})
        assert feed.resyncs > first_resyncs
    finally:
        await feed.close()
        publisher.close()



class Scripted:
    """Stands in for the feed's sockets: batches (topic, seq, payload) and connection drops, in
    a script's order, and the publisher's state as a replay read would give it."""

    def __init__(self, feed: PoolEventFeed, script: list) -> None:
        self.script, self.dropped, self.reads, self.parked = list(script), False, [], False
        self.feed, self.sub = feed, feed._sub
        feed._sub, feed._dropped, feed._read_state = self, self.drops, self.read_state

    def restore(self) -> None:
        self.feed._sub = self.sub

    async def recv_multipart(self):
        while self.script:
            step = self.script.pop(0)
            if step == "drop":
                self.dropped = True
                continue
            return step
        self.parked = True  # every batch handled: the feed waits, as on a quiet socket
        await asyncio.Event().wait()

    async def drops(self) -> bool:
        dropped, self.dropped = self.dropped, False
        return dropped

    async def read_state(self):
        self.reads.append(len(self.script))
        return [], -1


async def test_a_restarted_publisher_whose_numbers_continue_the_old_ones_is_still_read_afresh():
    """A new publisher's first batch heard may by chance carry the number after the old one's
    last (its earlier batches went out before the feed reconnected): the dropped connection,
    not the numbers, says the publisher is another, and the feed reads its state again."""
    noop = msgspec.msgpack.encode(event_types(True).batch(0.0, [], None))
    batches = [(b"", n.to_bytes(8, "big"), noop) for n in range(4)]
    feed = PoolEventFeed("inproc://unused", "inproc://unused")
    scripted = Scripted(feed, batches[:3] + ["drop"] + batches[3:])
    feed.start()
    try:
        await until(lambda: scripted.parked, "the feed to handle the script's batches", limit=60)
        assert scripted.reads == [4, 0], "read at the first batch (4 steps left), and again after the drop"
    finally:
        scripted.restore()
        await feed.close()
