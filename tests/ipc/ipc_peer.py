"""The other process of the ipc tests: ``python ipc_peer.py LOOP MODE END [ARGS...]``.

It refuses to import pickle, so a test that passes through it shows that nothing on the
IPC path pickles. LOOP is ``asyncio`` or ``uvloop``; MODE picks a behaviour below.
"""

import sys

sys.modules["pickle"] = sys.modules["_pickle"] = None  # "import pickle" now raises

import asyncio  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402

import msgspec  # noqa: E402
import uvloop  # noqa: E402

from ipc_testkit import (  # noqa: E402
    Echo,
    Message,
    Ready,
    Seq,
    Square,
    Squared,
    Stop,
    board_value,
    payload_stream,
)
from lmpool_ipc import BoardWriter, Channel, IpcPool, Responder  # noqa: E402


async def echo(end: str) -> None:
    """Send back every Echo; stop at Stop."""
    async with Channel(end, Message) as channel:
        while True:
            msg = await channel.recv()
            if type(msg) is Stop:
                await channel.send(msg)
                return
            await channel.send(msg)


async def stream(end: str) -> None:
    """Send Seq(0), Seq(1), ... until killed."""
    channel = Channel(end, Message)
    n = 0
    while True:
        await channel.send(Seq(n))
        n += 1


async def idle(end: str) -> None:
    """Say Ready, then wait without ever reading (until killed)."""
    channel = Channel(end, Message)
    await channel.send(Ready(os.getpid()))
    await asyncio.Event().wait()


async def flood(end: str, seed: str, count: str) -> None:
    """Send the payload stream ``seed`` of ``count`` messages as raw frames, then close."""
    async with Channel(end) as channel:
        for payload in payload_stream(int(seed), int(count)):
            await channel.send_bytes(payload)


async def garbage(end: str) -> None:
    """Send valid messages with three undecodable frames between them, then close."""
    async with Channel(end, Message) as channel:
        await channel.send(Seq(0))
        await channel.send_bytes(b"\xc1\xff garbage")
        await channel.send(Seq(1))
        await channel.send_bytes(msgspec.msgpack.encode(Echo(7, b"x" * 100))[:-10])  # truncated
        await channel.send(Seq(2))
        await channel.send_bytes(b"\x92\xa7Unknown\x01")  # a tag outside the union
        await channel.send(Seq(3))


async def rpc(end: str) -> None:
    """Answer Square requests, each after a random number of loop rounds, so replies
    go back in a different order than the requests came."""
    rng = random.Random(0)

    async def square(req: Square) -> Squared:
        for _ in range(rng.randrange(50)):
            await asyncio.sleep(0)
        return Squared(req.x, req.x * req.x)

    async with Channel(end) as channel:
        await Responder(channel, Square, square).serve()


def crash_pool() -> None:
    """Start a pool, create links and open an end, print the pool id, then wait for
    stdin to close (the test SIGKILLs us first)."""
    pool = IpcPool.start()
    links = [pool.create_link(1 << 16) for _ in range(2)]

    async def hold() -> None:
        Channel(links[0].a, Message)
        print(pool.pool_id, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(hold())


def publish(name: str) -> None:
    """Publish ``board_value(0)``, ``board_value(1)``, ... on board ``name`` until killed."""
    writer = BoardWriter(name)
    n = 0
    while True:
        writer.publish(board_value(n))
        n += 1


def crash_board() -> None:
    """Start a pool with one board, print the pool id, then wait for stdin to close (the
    test SIGKILLs us first)."""
    pool = IpcPool.start()
    pool.create_board("state", 4096)
    print(pool.pool_id, flush=True)
    sys.stdin.read()


MODES = {
    "echo": echo,
    "stream": stream,
    "idle": idle,
    "flood": flood,
    "garbage": garbage,
    "rpc": rpc,
}

if __name__ == "__main__":
    loop, mode, *args = sys.argv[1:]
    if mode == "crash-pool":
        crash_pool()
    elif mode == "crash-board":
        crash_board()
    elif mode == "publish":
        publish(*args)
    else:
        (uvloop.run if loop == "uvloop" else asyncio.run)(MODES[mode](*args))
