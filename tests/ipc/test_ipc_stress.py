"""A million messages of random sizes 0..64 KiB from another process through a 1 MiB
ring (about 32 GB: the ring wraps some 30,000 times): all arrive, in order, byte-equal,
each once."""

import pytest
from ipc_testkit import payload_stream

from lmpool_ipc import Channel, ChannelClosedError

COUNT = 1_000_000
SEED = 20240601


@pytest.mark.slow
def test_a_million_random_messages_through_a_1mib_ring(pool, run, spawn):
    link = pool.create_link(capacity=1 << 20)

    async def main():
        async with Channel(link.a) as channel:
            channel.expect_peer(spawn("flood", link.b, SEED, COUNT).pid)
            received = 0
            for expected in payload_stream(SEED, COUNT):
                payload = await channel.recv_bytes()
                if payload != expected:
                    pytest.fail(f"message {received} differs ({len(payload)} bytes)")
                received += 1
            with pytest.raises(ChannelClosedError):  # and nothing after the last one
                await channel.recv_bytes()
            assert received == channel.stats.received == COUNT

    run(main())
