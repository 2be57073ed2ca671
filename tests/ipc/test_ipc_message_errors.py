"""A message's own failure (too large, undecodable) is told apart from a link's failure:
the first is a ``MessageError`` that leaves the link working, only the second a
``LinkError``; a reply too large for the ring fails its request, not the link."""

import asyncio

import pytest
from ipc_testkit import Square, Squared

from lmpool_ipc import (
    Channel,
    ChannelClosedError,
    DecodeError,
    LinkError,
    MessageError,
    MessageTooLargeError,
    PeerDeadError,
    RemoteError,
    Requester,
    Responder,
    RingCorruptError,
)


@pytest.mark.parametrize("error", [DecodeError, MessageTooLargeError])
def test_a_message_failure_is_not_a_link_failure(error):
    assert issubclass(error, MessageError) and issubclass(error, ValueError)
    assert not issubclass(error, (LinkError, ConnectionError))


@pytest.mark.parametrize("error", [PeerDeadError, ChannelClosedError, RingCorruptError])
def test_a_link_failure_is_not_a_message_failure(error):
    assert issubclass(error, LinkError) and not issubclass(error, MessageError)


def test_a_reply_too_large_for_the_ring_fails_its_request_only(pool, run):
    link = pool.create_link(capacity=4096)

    async def handle(req: Square) -> Squared | bytes:
        return bytes(10_000) if req.x < 0 else Squared(req.x, req.x * req.x)

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            server = Responder(b, Square, handle)
            serving = asyncio.create_task(server.serve())
            requester = Requester(a, Squared | bytes)
            with pytest.raises(RemoteError, match="10.* bytes does not fit"):
                await requester.request(Square(-1))
            assert await requester.request(Square(3)) == Squared(3, 9)
            requester.close()
            a.close()
            await serving

    run(main())


def test_a_request_too_large_for_the_ring_raises_and_the_link_lives(pool, run):
    link = pool.create_link(capacity=4096)

    async def handle(req) -> int:
        return len(req)

    async def main():
        async with Channel(link.a) as a, Channel(link.b) as b:
            serving = asyncio.create_task(Responder(b, bytes, handle).serve())
            requester = Requester(a, int)
            with pytest.raises(MessageTooLargeError, match=r"at most 4088 bytes"):
                await requester.request(bytes(5000))
            assert await requester.request(bytes(100)) == 100
            requester.close()
            a.close()
            await serving

    run(main())
