"""The asyncio channel (lmpool_ipc.Channel), on asyncio and uvloop: typed messages,
backpressure, size limits, decode errors, closing, and a peer in another process."""

import asyncio
import os
import stat

import msgspec
import pytest
from ipc_testkit import Echo, Message, Seq, Stop

from lmpool_ipc import (
    Channel,
    ChannelClosedError,
    DecodeError,
    IpcError,
    MessageTooLargeError,
)
from lmpool_ipc.lifecycle import pool_objects


def test_messages_of_a_tagged_union_round_trip(pool, run):
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as a, Channel(link.b, Message) as b:
            sent = [Echo(1, b"x"), Seq(2), Stop(), Echo(3, bytes(range(256)) * 40)]
            for msg in sent:
                await a.send(msg)
            assert [await b.recv() for _ in sent] == sent
            await b.send(Seq(9))
            assert await a.recv() == Seq(9)
            assert (a.stats.sent, b.stats.received, b.stats.decode_errors) == (4, 4, 0)

    run(main())


def test_send_waits_while_the_ring_is_full(pool, run):
    link = pool.create_link(capacity=4096)

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            payload = b"p" * 1000
            for _ in range(4):  # four 1008-byte frames fill 4032 of 4096 bytes
                await a.send_bytes(payload)
            last = b"L" * 1000
            blocked = asyncio.create_task(a.send_bytes(last))
            for _ in range(100):  # the sender cannot finish however long it runs
                await asyncio.sleep(0)
            assert not blocked.done()
            assert await b.recv_bytes() == payload  # frees space: the sender resumes
            await blocked
            assert [await b.recv_bytes() for _ in range(4)] == [payload] * 3 + [last]

    run(main())


def test_many_large_messages_flow_through_a_small_ring_in_order(pool, run):
    link = pool.create_link(capacity=64 * 1024)

    async def main():
        async with Channel(link.a, Message) as a, Channel(link.b, Message) as b:

            async def produce():
                for i in range(300):
                    await a.send(Echo(i, bytes([i % 256]) * (i * 97 % 30000)))

            producer = asyncio.create_task(produce())
            for i in range(300):
                assert await b.recv() == Echo(i, bytes([i % 256]) * (i * 97 % 30000))
            await producer

    run(main())


def test_a_message_larger_than_the_ring_is_refused_at_once(pool, run):
    link = pool.create_link(capacity=4096)

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            with pytest.raises(MessageTooLargeError, match="4089 bytes does not fit"):
                await a.send_bytes(bytes(4089))
            with pytest.raises(MessageTooLargeError, match="at most 4088 bytes"):
                await a.send(bytes(5000))
            await a.send_bytes(bytes(4088))  # exactly the ring: fits when empty
            assert await b.recv_bytes() == bytes(4088)

    run(main())


def test_bad_frames_raise_decode_errors_and_the_next_message_arrives(pool, run, spawn):
    """Garbage, a truncated message and an unknown tag, each between valid messages,
    sent by another process."""
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            channel.expect_peer(spawn("garbage", link.b).pid)
            assert await channel.recv() == Seq(0)
            with pytest.raises(DecodeError, match="is not a valid"):
                await channel.recv()
            assert await channel.recv() == Seq(1)
            with pytest.raises(DecodeError, match="truncated"):
                await channel.recv()
            assert await channel.recv() == Seq(2)
            with pytest.raises(DecodeError, match="Unknown"):
                await channel.recv()
            assert await channel.recv() == Seq(3)
            assert channel.stats.decode_errors == 3
            with pytest.raises(ChannelClosedError, match="closed the channel"):
                await channel.recv()

    run(main())


def test_a_reader_loop_skips_bad_frames_and_ends_with_the_link(pool, run, spawn):
    """``messages()``: the same frames read as a reader's loop: the valid messages in order,
    the bad ones counted, and the link's end raised out of the loop."""
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            channel.expect_peer(spawn("garbage", link.b).pid)
            got = []
            with pytest.raises(ChannelClosedError, match="closed the channel"):
                async for msg in channel.messages():
                    got.append(msg)
            assert got == [Seq(0), Seq(1), Seq(2), Seq(3)]
            assert channel.stats.decode_errors == 3

    run(main())


def test_echo_through_a_peer_process(pool, run, spawn):
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            peer = spawn("echo", link.b)
            channel.expect_peer(peer.pid)
            for i in range(2000):
                await channel.send(Echo(i, os.urandom(i % 3000)))
                reply = await channel.recv()
                assert reply.seq == i
            await channel.send(Stop())
            assert await channel.recv() == Stop()
            assert channel.peer_pid == peer.pid

    run(main())


def test_closing_wakes_the_peer_after_it_drained_what_was_sent(pool, run):
    link = pool.create_link()

    async def main():
        a = Channel(link.a, Message)
        async with Channel(link.b, Message) as b:
            waiting = asyncio.create_task(b.recv())
            await a.send(Seq(1))
            await a.send(Seq(2))
            a.close()
            assert await waiting == Seq(1)
            assert await b.recv() == Seq(2)
            with pytest.raises(ChannelClosedError, match="closed the channel"):
                await b.recv()
            with pytest.raises(ChannelClosedError, match="closed the channel"):
                await b.send(Seq(3))
            with pytest.raises(ChannelClosedError, match="is closed"):
                await a.send(Seq(3))

    run(main())


def test_closing_fails_our_own_pending_recv(pool, run):
    link = pool.create_link()

    async def main():
        async with Channel(link.b):
            a = Channel(link.a)
            pending = asyncio.create_task(a.recv())
            await asyncio.sleep(0)
            a.close()
            with pytest.raises(ChannelClosedError):
                await pending

    run(main())


def test_an_end_opens_once_and_only_while_it_exists(pool, run):
    link = pool.create_link()

    async def main():
        async with Channel(link.a):
            with pytest.raises(IpcError, match="already open"):
                Channel(link.a)
        with pytest.raises(ChannelClosedError, match="ends do not reopen"):
            Channel(link.a)
        with pytest.raises(ChannelClosedError, match="does not exist"):
            Channel(link.a.replace(link.a[8:40], "0" * 32))
        with pytest.raises(ValueError, match="not an LMPool link end"):
            Channel("/tmp/whatever:a")

    run(main())


def test_segments_and_semaphores_are_private_to_the_user(pool):
    pool.create_link()
    objects = [o for o in pool_objects() if o.parsed.pool_id == pool.pool_id]
    assert sorted(o.kind for o in objects) == ["sem", "sem", "shm", "shm"]
    for obj in objects:
        path = "/dev/shm/" + ("sem." if obj.kind == "sem" else "") + obj.name[1:]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_channel_decodes_with_the_users_type(pool, run):
    class Point(msgspec.Struct):
        x: int
        y: int

    link = pool.create_link()

    async def main():
        async with Channel(link.a, Point) as a, Channel(link.b, Point) as b:
            await a.send(Point(1, 2))
            assert await b.recv() == Point(1, 2)
            await a.send({"x": 1, "y": "two"})
            with pytest.raises(DecodeError, match=r"Point.*Expected `int`, got `str`"):
                await b.recv()

    run(main())


def test_an_idle_wait_sleeps_on_the_semaphore_and_a_send_wakes_it(pool, run):
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as a, Channel(link.b, Message) as b:
            for n in range(3):
                waiting = asyncio.create_task(b.recv())
                while b.stats.parks == n:  # let the spin run out: the wait goes to sleep
                    await asyncio.sleep(0.001)
                assert not waiting.done()
                await a.send(Seq(n))  # the sleeper declared itself: this send posts
                assert await waiting == Seq(n)

    run(main())
