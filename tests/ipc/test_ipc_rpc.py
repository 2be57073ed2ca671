"""Request/response (lmpool_ipc.Requester / Responder): replies reach their own caller
whatever order they come back in, and failures reach the caller they concern."""

import asyncio
import random

import msgspec
import pytest
from ipc_testkit import Square, Squared

from lmpool_ipc import (
    Channel,
    DecodeError,
    PeerDeadError,
    RemoteError,
    Requester,
    Responder,
)


def test_concurrent_requests_get_their_own_replies_in_process(pool, run):
    """The responder holds every request until all have arrived, then answers them in a
    shuffled order."""
    link = pool.create_link()
    count = 300

    async def main():
        arrived: list[asyncio.Future] = []
        all_arrived = asyncio.Event()

        async def handle(req: Square) -> Squared:
            turn = asyncio.get_running_loop().create_future()
            arrived.append(turn)
            if len(arrived) == count:
                all_arrived.set()
            await turn
            return Squared(req.x, req.x * req.x)

        async def release_shuffled():
            await all_arrived.wait()
            for turn in random.Random(7).sample(arrived, count):
                turn.set_result(None)
                await asyncio.sleep(0)

        async with Channel(link.a) as a, Channel(link.b) as b:
            server = asyncio.create_task(Responder(b, Square, handle).serve())
            shuffler = asyncio.create_task(release_shuffled())
            requester = Requester(a, Squared)
            replies = await asyncio.gather(*(requester.request(Square(x)) for x in range(count)))
            assert replies == [Squared(x, x * x) for x in range(count)]
            await shuffler
            a.close()
            await server  # returns once the requester's end is closed

    run(main())


def test_concurrent_requests_to_another_process(pool, run, spawn):
    link = pool.create_link()

    async def main():
        async with Channel(link.a) as channel:
            channel.expect_peer(spawn("rpc", link.b).pid)
            requester = Requester(channel, Squared)
            for _ in range(3):
                xs = random.sample(range(10**6), 500)
                replies = await asyncio.gather(*(requester.request(Square(x)) for x in xs))
                assert replies == [Squared(x, x * x) for x in xs]

    run(main())


def test_failures_reach_only_the_request_they_concern(pool, run):
    link = pool.create_link()

    class Wrong(msgspec.Struct):
        text: str

    async def handle(req: Square):
        if req.x == 1:
            raise ValueError("no ones")
        if req.x == 2:
            return Wrong("not a Squared")
        return Squared(req.x, req.x * req.x)

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            server = asyncio.create_task(Responder(b, Square, handle).serve())
            requester = Requester(a, Squared)
            results = await asyncio.gather(
                *(requester.request(Square(x)) for x in range(4)), return_exceptions=True
            )
            assert results[0] == Squared(0, 0) and results[3] == Squared(3, 9)
            assert isinstance(results[1], RemoteError) and "ValueError: no ones" in str(results[1])
            assert isinstance(results[2], DecodeError) and "reply to request" in str(results[2])
            bad = await asyncio.gather(requester.request("not a Square"), return_exceptions=True)
            assert isinstance(bad[0], RemoteError) and "Expected `array`" in str(bad[0])
            a.close()
            await server

    run(main())


def test_after_reply_runs_once_each_reply_is_written_failures_included(pool, run):
    """The hook runs after each reply's frame is in the ring (the channel counted it sent),
    once per request, for a failed handler too."""
    link = pool.create_link()

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            sent_at_hook: list[int] = []

            async def handle(req: Square) -> Squared:
                if req.x < 0:
                    raise ValueError("negative")
                return Squared(req.x, req.x * req.x)

            server = asyncio.create_task(
                Responder(b, Square, handle, after_reply=lambda: sent_at_hook.append(b.stats.sent)).serve())
            requester = Requester(a, Squared)
            assert await requester.request(Square(3)) == Squared(3, 9)
            with pytest.raises(RemoteError):
                await requester.request(Square(-1))
            assert await requester.request(Square(4)) == Squared(4, 16)
            assert sent_at_hook == [1, 2, 3]  # each hook after its own reply was written
            a.close()
            await server

    run(main())


def test_a_cancelled_request_does_not_disturb_the_others(pool, run):
    link = pool.create_link()

    async def main():
        gate = asyncio.Event()

        async def handle(req: Square) -> Squared:
            if req.x == 0:
                await gate.wait()
            return Squared(req.x, req.x * req.x)

        async with Channel(link.a) as a, Channel(link.b) as b:
            server = asyncio.create_task(Responder(b, Square, handle).serve())
            requester = Requester(a, Squared)
            slow = asyncio.create_task(requester.request(Square(0)))
            assert await requester.request(Square(5)) == Squared(5, 25)
            slow.cancel()
            gate.set()  # the late reply to the cancelled request is dropped
            assert await requester.request(Square(6)) == Squared(6, 36)
            assert requester.stale_replies == 1
            a.close()
            await server

    run(main())


def test_requests_in_flight_fail_when_the_responder_dies(pool, run, spawn):
    link = pool.create_link()

    async def main():
        async with Channel(link.a) as channel:
            peer = spawn("idle", link.b)  # reads nothing, answers nothing
            channel.expect_peer(peer.pid)
            requester = Requester(channel, Squared)
            pending = [asyncio.create_task(requester.request(Square(x))) for x in range(5)]
            await asyncio.sleep(0)
            peer.kill()
            for task in pending:
                with pytest.raises(PeerDeadError, match=f"peer process {peer.pid}"):
                    await task
            with pytest.raises(PeerDeadError):
                await requester.request(Square(9))

    run(main())
