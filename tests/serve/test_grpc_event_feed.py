"""``PoolEventFeed``: the pool's KV-event publisher, read in the serving process, in one loop.

The feed reads the publisher's full state when it starts hearing it (what it missed before its
subscription took is there), and again when the publisher restarts (a control process replaced:
its numbers begin again): the host then holds the new publisher's blocks only."""

from __future__ import annotations

from waiting import until

from lmpool.control.kv_events.publisher import KVEventPublisher
from lmpool.frontend.grpc.event_feed import PoolEventFeed

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
