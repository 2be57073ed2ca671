"""No shared memory outlives its pool however the owner lets go: a forgotten ``close``
(garbage collection), interpreter exit, SIGTERM to the owner of a live pool; and a pool
used from another event loop than its own says so instead of hanging."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmpool import SamplingParams
from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend.client import PoolError
from lmpool_ipc import IpcPool
from lmpool_ipc.lifecycle import pool_objects

POOL_OWNER = Path(__file__).parents[1] / "tools" / "pool_owner.py"
OWN_POOL = """
import sys
from lmpool_ipc import IpcPool
pool = IpcPool.start()
pool.create_link(capacity=4096)
pool.create_board("state", 4096)
print(pool.pool_id, flush=True)
if sys.argv[1] == "wait":
    sys.stdin.read()
"""


def objects_of(pool_id: str) -> list[str]:
    return [o.name for o in pool_objects() if o.parsed.pool_id == pool_id]


def test_a_pool_dropped_without_close_is_removed_when_collected():
    pool = IpcPool.start()
    pool.create_link(capacity=4096)
    pool_id = pool.pool_id
    assert len(objects_of(pool_id)) == 4
    del pool
    gc.collect()
    assert objects_of(pool_id) == []


def test_a_pool_never_closed_is_removed_at_interpreter_exit():
    done = subprocess.run([sys.executable, "-c", OWN_POOL, "exit"], capture_output=True, text=True, check=True)
    assert objects_of(done.stdout.strip()) == []


def test_sigterm_to_the_owner_removes_its_pool_and_still_kills_it():
    owner = subprocess.Popen([sys.executable, "-c", OWN_POOL, "wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    pool_id = owner.stdout.readline().strip()
    assert len(objects_of(pool_id)) == 5
    owner.send_signal(signal.SIGTERM)
    assert owner.wait() == -signal.SIGTERM
    owner.stdin.close()
    owner.stdout.close()
    assert objects_of(pool_id) == []


def test_sigterm_to_the_owner_of_a_serving_pool_leaves_nothing(tiny_model):
    owner = subprocess.Popen([sys.executable, str(POOL_OWNER), tiny_model], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    started = json.loads(owner.stdout.readline())
    assert objects_of(started["pool_id"])
    owner.send_signal(signal.SIGTERM)
    assert owner.wait() == -signal.SIGTERM
    owner.stdin.close()
    owner.stdout.close()
    assert objects_of(started["pool_id"]) == []  # its children die with it (PR_SET_PDEATHSIG)


def test_a_pool_used_from_another_event_loop_raises(tiny_model):
    home = asyncio.new_event_loop()
    pool = AsyncLMPool(tiny_model, world_size=1, block_size=16)
    home.run_until_complete(pool.start())
    try:
        with pytest.raises(PoolError, match="started on another event loop"):
            asyncio.run(pool.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        with pytest.raises(PoolError, match="started on another event loop"):
            asyncio.run(pool.stats())
        out = home.run_until_complete(pool.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2)))
        assert len(out.token_ids) == 2
    finally:
        home.run_until_complete(pool.shutdown())
        home.close()
