"""The pool tests' leak check (``leak_check.lmpool_shm``) counts what this test run's pools left,
and no pool of another live process: not even the links of that pool's dead control process,
which a run alongside this one killed and whose successor has yet to sweep them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from leak_check import lmpool_shm

from lmpool_ipc.names import SHM_DIR, board_name, new_link_prefix, new_pool_id, object_name


@pytest.fixture
def pids():
    """A live process other than this one, and a dead one."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    yield live.pid, dead.pid
    live.kill()
    live.wait()


def plant(pool_id: str, owner: int) -> str:
    name = object_name(new_link_prefix(pool_id, owner), "ab").removeprefix("/")
    open(os.path.join(SHM_DIR, name), "x").close()
    return name


def test_only_pools_of_no_other_live_process_count(pids):
    live, dead = pids
    foreign, abandoned, own = new_pool_id(), new_pool_id(), new_pool_id()
    planted = [plant(foreign, live), plant(foreign, dead), plant(abandoned, dead), plant(own, os.getpid()),
               board_name(own, dead, "state").removeprefix("/")]
    open(os.path.join(SHM_DIR, planted[-1]), "x").close()
    try:
        counted = lmpool_shm() & set(planted)
        assert counted == set(planted[2:])  # the dead owner's pool with no live stranger, and this process's
    finally:
        for name in planted:
            os.unlink(os.path.join(SHM_DIR, name))
