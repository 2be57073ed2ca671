"""Dead peers, closing, and removal of shared-memory objects (lmpool_ipc.lifecycle,
IpcPool): a killed peer is reported to a wait on it (a sleeping wait checks its peer every
``liveness_interval``; no wall-clock bound is asserted, a loaded machine may take its time; a
wait that never learns fails the test after ``FAILURE_S``), and nothing of a pool outlives it."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from ipc_testkit import Message, Ready, Seq, leftovers

from lmpool_ipc import Channel, IpcPool, PeerDeadError, sweep_dead_pools
from lmpool_ipc.lifecycle import pid_alive

FAILURE_S = 60.0  # how long a wait that never learns of its dead peer takes to fail the test


async def kill_and_expect_death(pid: int, blocked: asyncio.Task) -> None:
    """SIGKILL ``pid``; ``blocked``, a channel wait on it, must fail with ``PeerDeadError``."""
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(PeerDeadError):
        await asyncio.wait_for(blocked, FAILURE_S)


def test_peer_killed_mid_stream_is_reported(pool, run, spawn):
    """The peer streams until SIGKILLed; we drain what it sent, then recv() raises. The
    peer is not reaped before that: a zombie must count as dead."""
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            peer = spawn("stream", link.b)
            channel.expect_peer(peer.pid)
            for n in range(20000):
                assert await channel.recv() == Seq(n)
            os.kill(peer.pid, signal.SIGKILL)
            with pytest.raises(PeerDeadError, match=f"peer process {peer.pid} has exited"):
                while True:
                    n += 1
                    assert await asyncio.wait_for(channel.recv(), FAILURE_S) == Seq(n)  # in order up to the end

    run(main())


def test_peer_killed_while_we_sleep_in_recv(pool, run, spawn):
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            peer = spawn("idle", link.b)
            assert await channel.recv() == Ready(peer.pid)
            waiting = asyncio.create_task(channel.recv())
            await asyncio.sleep(0)
            await kill_and_expect_death(peer.pid, waiting)

    run(main())


def test_peer_killed_while_we_wait_for_ring_space(pool, run, spawn):
    link = pool.create_link(capacity=4096)

    async def main():
        async with Channel(link.a, Message) as channel:
            peer = spawn("idle", link.b)  # never reads: the ring fills up
            assert await channel.recv() == Ready(peer.pid)
            while True:  # a send that cannot finish in its first step waits for space
                sending = asyncio.create_task(channel.send_bytes(bytes(1000)))
                await asyncio.sleep(0)
                if not sending.done():
                    break
                await sending
            await kill_and_expect_death(peer.pid, sending)

    run(main())


def test_missed_heartbeat_is_reported(pool, run, spawn):
    """A stopped peer still has a pid; its silence is what gives it away."""
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message, heartbeat_timeout=0.5) as channel:
            peer = spawn("idle", link.b)
            assert await channel.recv() == Ready(peer.pid)
            os.kill(peer.pid, signal.SIGSTOP)
            with pytest.raises(PeerDeadError, match="missed its heartbeat"):
                await channel.recv()

    run(main())


def test_silence_before_watching_starts_is_not_held_against_the_peer(pool, run, spawn, monkeypatch):
    """A clock ten seconds ahead makes every beat of a live peer look ten seconds old: only
    silence after ``watch_heartbeat`` counts, and then it does."""
    import lmpool_ipc.channel as channel_module

    link = pool.create_link()
    ahead = [10_000_000_000]
    real = time.monotonic_ns

    class Clock:
        @staticmethod
        def monotonic_ns() -> int:
            return real() + ahead[0]

    async def main():
        async with Channel(link.a, Message) as channel:
            peer = spawn("idle", link.b)
            assert await channel.recv() == Ready(peer.pid)
            monkeypatch.setattr(channel_module, "time", Clock)
            assert channel._peer_failure(sending=False) is None  # not watched
            channel.watch_heartbeat(0.5)
            assert channel._peer_failure(sending=False) is None  # old silence: not counted
            ahead[0] += 1_000_000_000
            failure = channel._peer_failure(sending=False)
            assert isinstance(failure, PeerDeadError) and "missed its heartbeat" in str(failure)
            channel.watch_heartbeat(None)
            assert channel._peer_failure(sending=False) is None
            with pytest.raises(ValueError, match="> 0 seconds"):
                channel.watch_heartbeat(0)

    run(main())


def test_a_peer_that_dies_before_opening_its_end(pool, run):
    link = pool.create_link()

    async def main():
        async with Channel(link.a, Message) as channel:
            child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
            channel.expect_peer(child.pid)
            with pytest.raises(PeerDeadError, match=str(child.pid)):
                await channel.recv()
            child.wait()

    run(main())


def test_pool_close_removes_every_object_and_open_channels_keep_working(run):
    pool = IpcPool.start()
    link = pool.create_link()
    created = leftovers(pool.pool_id)
    assert len(created) == 4  # two rings, two semaphores

    async def main():
        async with Channel(link.a, Message) as a, Channel(link.b, Message) as b:
            assert sorted(pool.close()) == sorted(created)
            assert leftovers(pool.pool_id) == []
            await a.send(Seq(1))  # the mappings outlive the names
            assert await b.recv() == Seq(1)

    run(main())


def test_removing_a_link_unlinks_its_objects_only_and_its_open_channels_keep_working(run):
    with IpcPool.start() as pool:
        kept, done = pool.create_link(), pool.create_link()
        before = leftovers(pool.pool_id)

        async def main():
            async with Channel(done.a, Message) as a, Channel(done.b, Message) as b:
                removed = pool.remove_link(done)
                await a.send(Seq(1))  # the mappings outlive the names
                return removed, await b.recv()

        removed, got = run(main())
        assert len(removed) == 4 and got == Seq(1)
        assert sorted(leftovers(pool.pool_id)) == sorted(set(before) - set(removed))
        assert pool.remove_link(done) == []  # already gone
        async def still_open():
            async with Channel(kept.a, Message), Channel(kept.b, Message):
                return True
        assert run(still_open())


def test_a_pool_started_after_a_crash_removes_its_leftovers(loop_name, spawn):
    crashed = spawn("crash-pool", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    crashed_pool = crashed.stdout.readline().strip()
    assert len(leftovers(crashed_pool)) == 8  # two links, one end open
    crashed.kill()
    crashed.wait()
    assert len(leftovers(crashed_pool)) == 8  # nothing removes them on its own
    with IpcPool.start() as pool:
        assert leftovers(crashed_pool) == []
        assert pool.pool_id != crashed_pool


def test_the_sweeper_leaves_live_pools_alone(pool):
    pool.create_link()
    sweep_dead_pools()
    assert len(leftovers(pool.pool_id)) == 4


def test_pid_liveness():
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    assert not pid_alive(child.pid)  # a zombie is dead
    child.wait()
    assert not pid_alive(child.pid)


def test_a_link_that_cannot_be_created_leaves_nothing(pool):
    with pytest.raises(ValueError, match="multiple of 8"):
        pool.create_link(capacity=1001)
    assert leftovers(pool.pool_id) == []


def test_a_link_past_the_whole_shared_memory_filesystem_is_refused_and_leaves_nothing(pool, monkeypatch):
    """A ring's pages are taken as it first writes them: rings that, with the pool's others,
    exceed the filesystem's size would fail later with SIGBUS, so the link is refused at once,
    with the sizes, and nothing of it is created; other processes' use is not counted."""
    import lmpool_ipc.pool as ipc_pool
    from lmpool_ipc import SharedMemoryTooSmallError
    from lmpool_ipc.ring import ring_bytes

    real = os.statvfs(ipc_pool.SHM_DIR)
    limit = 10 << 20

    class Small:
        f_frsize = 4096
        f_blocks = limit // 4096
        f_bavail = real.f_bavail  # free space is not what counts

    monkeypatch.setattr(ipc_pool.os, "statvfs", lambda path: Small())
    pool.create_link(4 << 20)  # two rings of 4 MiB: 8 of the 10
    before = leftovers(pool.pool_id)
    with pytest.raises(SharedMemoryTooSmallError, match=r"holds 10 MiB in all.* would take 16 MiB"):
        pool.create_link(4 << 20)
    assert leftovers(pool.pool_id) == before
    assert 2 * ring_bytes(1 << 19) + 2 * ring_bytes(4 << 20) <= limit
    pool.create_link(1 << 19)  # what still fits
