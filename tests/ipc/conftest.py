"""Fixtures of the ipc tests: an event loop of each kind, a pool whose objects must all
be gone after the test, and peer processes that are always reaped."""

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import uvloop
from ipc_testkit import leftovers

from lmpool_ipc import IpcPool
from lmpool_ipc.lifecycle import pool_objects

PEER = Path(__file__).with_name("ipc_peer.py")
HANG_GUARD_S = 120  # turns a hang into a failure; never reached by a passing test


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_name(request) -> str:
    return request.param


@pytest.fixture
def run(loop_name):
    """Run a coroutine to completion on a fresh loop of the parametrized kind."""

    def run(coro):
        async def guarded():
            return await asyncio.wait_for(coro, HANG_GUARD_S)

        return (uvloop.run if loop_name == "uvloop" else asyncio.run)(guarded())

    return run


@pytest.fixture
def pool():
    pool = IpcPool.start()
    yield pool
    pool.close()
    assert leftovers(pool.pool_id) == []


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After every test: no segment or semaphore of a pool this process started, and no
    channel left open (each open channel has a bell thread)."""
    before = set(pool_objects())
    yield
    ours = [o.name for o in set(pool_objects()) - before if o.parsed.owner_pid == os.getpid()]
    assert ours == []
    bells = [t.name for t in threading.enumerate() if t.name.startswith("lmpool-ipc-bell")]
    assert bells == []


@pytest.fixture
def spawn(loop_name):
    """Start ``ipc_peer.py`` in a new process; every peer is killed and reaped after the
    test."""
    started: list[subprocess.Popen] = []

    def spawn(mode: str, *args: str, **popen_kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(PEER), loop_name, mode, *map(str, args)], **popen_kwargs
        )
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
