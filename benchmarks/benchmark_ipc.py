"""Shared-memory ring vs multiprocessing.Queue vs multiprocessing.Pipe, side by side.

For 64 B, 1 KiB and 64 KiB payloads and each transport, a parent and a child process
measure:

- round-trip latency: the parent sends one message, the child echoes it back, repeated;
  p50 and p99 in microseconds;
- one-way throughput: the parent sends a burst of messages, the child counts them and
  answers a final ``done``; messages per second from the first send to that answer, the
  median over the rounds.

The three transports take turns in short rounds within each size, so that a change in the
machine's load during the run hits them alike. The ring runs as LMPool uses it: ``lmpool_ipc.Channel``
on uvloop in both processes, typed msgspec messages. Queue and Pipe carry
``(kind, payload)`` tuples (pickled, as those transports do), driven from the same
event loop with their blocking calls.

    python -m benchmarks.benchmark_ipc --json results.json

A bar on stderr counts the rounds (``--no-progress``: none).
"""

import argparse
import json
import statistics
import multiprocessing as mp
import subprocess
import sys
import time

import msgspec
import uvloop

from benchmarks.lib.progress import add_argument as add_progress_argument
from benchmarks.lib.progress import bar
from lmpool_ipc import Channel, IpcPool

SIZES = (64, 1024, 65536)
RING_CAPACITY = 1 << 20


class Echo(msgspec.Struct, tag=True, array_like=True, gc=False):
    payload: bytes


class Sink(msgspec.Struct, tag=True, array_like=True, gc=False):
    payload: bytes


class Done(msgspec.Struct, tag=True, array_like=True, gc=False):
    count: int = 0


Message = Echo | Sink | Done


def summarize(rtts_ns: list[int], rates: list[float]) -> dict:
    rtts_ns = sorted(rtts_ns)
    return {
        "rtt_p50_us": round(rtts_ns[len(rtts_ns) // 2] / 1000, 2),
        "rtt_p99_us": round(rtts_ns[int(len(rtts_ns) * 0.99)] / 1000, 2),
        "msgs_per_s": round(statistics.median(rates)),
    }


# Shared-memory ring --------------------------------------------------------------


async def ring_child(end: str) -> None:
    async with Channel(end, Message) as channel:
        sunk = 0
        while True:
            msg = await channel.recv()
            if type(msg) is Echo:
                await channel.send(msg)
            elif type(msg) is Sink:
                sunk += 1
            else:
                await channel.send(Done(sunk))
                sunk = 0
                if msg.count < 0:
                    return


class RingDriver:
    """The parent's side of the ring: a Channel on the running uvloop loop."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def round_trip(self, payload: bytes) -> None:
        await self.channel.send(Echo(payload))
        await self.channel.recv()

    async def burst(self, payload: bytes, count: int) -> None:
        for _ in range(count):
            await self.channel.send(Sink(payload))
        await self.channel.send(Done())
        done = await self.channel.recv()
        assert done.count == count, done

    async def stop(self) -> None:
        await self.channel.send(Done(-1))
        await self.channel.recv()


class MpDriver:
    """The parent's side of a multiprocessing Queue pair or Pipe (blocking calls)."""

    def __init__(self, get, put) -> None:
        self.get, self.put = get, put

    async def round_trip(self, payload: bytes) -> None:
        self.put(("echo", payload))
        self.get()

    async def burst(self, payload: bytes, count: int) -> None:
        for _ in range(count):
            self.put(("sink", payload))
        self.put(("done", 0))
        _, sunk = self.get()
        assert sunk == count, sunk

    async def stop(self) -> None:
        self.put(("done", -1))
        self.get()


def queue_child(inbox, outbox) -> None:
    serve(inbox.get, outbox.put)


def pipe_child(conn) -> None:
    serve(conn.recv, conn.send)


def serve(get, put) -> None:
    sunk = 0
    while True:
        kind, payload = get()
        if kind == "echo":
            put((kind, payload))
        elif kind == "sink":
            sunk += 1
        else:
            put(("done", sunk))
            sunk = 0
            if payload == -1:
                return


async def measure(drivers: dict, args) -> dict:
    """Every size on every transport. Within a size the transports take turns in
    ``--rounds`` short rounds (round trips, then one burst), so that a change in the
    machine's load during the run hits them alike."""
    results: dict = {name: {} for name in drivers}
    # Advanced between the timed loops, never inside one.
    shown = bar(len(SIZES) * len(drivers) * (args.rounds + 1), "ipc", unit="round", enabled=not args.no_progress)
    for size in SIZES:
        payload = bytes(size)
        count = args.burst if size < 65536 else args.burst // 10
        rtts: dict = {name: [] for name in drivers}
        rates: dict = {name: [] for name in drivers}
        for name, driver in drivers.items():
            for _ in range(args.warmup):
                await driver.round_trip(payload)
            shown.update()
        for _ in range(args.rounds):
            for name, driver in drivers.items():
                for _ in range(args.rtt_count // args.rounds):
                    start = time.perf_counter_ns()
                    await driver.round_trip(payload)
                    rtts[name].append(time.perf_counter_ns() - start)
                start = time.perf_counter()
                await driver.burst(payload, count)
                rates[name].append(count / (time.perf_counter() - start))
                shown.update()
        for name in drivers:
            results[name][str(size)] = summarize(rtts[name], rates[name])
    shown.close()
    for driver in drivers.values():
        await driver.stop()
    return results


async def bench(args) -> dict:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    ours, theirs = ctx.Pipe()
    children = [
        ctx.Process(target=queue_child, args=(inbox, outbox)),
        ctx.Process(target=pipe_child, args=(theirs,)),
    ]
    pool = IpcPool.start()
    try:
        link = pool.create_link(RING_CAPACITY)
        # The same module in a fresh interpreter, from the same working directory (the
        # repository root, where ``benchmarks`` imports from).
        ring_child_proc = subprocess.Popen([sys.executable, "-m", "benchmarks.benchmark_ipc", "--ring-child", link.b])
        for child in children:
            child.start()
        async with Channel(link.a, Message) as channel:
            channel.expect_peer(ring_child_proc.pid)
            drivers = {
                "shm_ring": RingDriver(channel),
                "mp_queue": MpDriver(outbox.get, inbox.put),
                "mp_pipe": MpDriver(ours.recv, ours.send),
            }
            return await measure(drivers, args)
    finally:
        for child in children:  # each has exited after "stop", unless we failed
            child.join(timeout=5)
            child.kill()
        ring_child_proc.kill()
        ring_child_proc.wait()
        pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--rtt-count", type=int, default=20000, help="round trips per size")
    parser.add_argument("--warmup", type=int, default=1000, help="untimed round trips first")
    parser.add_argument(
        "--burst", type=int, default=100000, help="messages per burst (a tenth at 64 KiB)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds per size, each of rtt-count/rounds round trips and one burst; the "
        "median burst rate is reported",
    )
    parser.add_argument("--ring-child", metavar="END", help=argparse.SUPPRESS)
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    if args.ring_child:
        uvloop.run(ring_child(args.ring_child))
        return
    results = uvloop.run(bench(args))
    print(f"{'transport':<10} {'size':>6} {'rtt p50 us':>11} {'rtt p99 us':>11} {'msgs/s':>10}")
    for transport, by_size in results.items():
        for size, r in by_size.items():
            print(
                f"{transport:<10} {size:>6} {r['rtt_p50_us']:>11} {r['rtt_p99_us']:>11} "
                f"{r['msgs_per_s']:>10}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
