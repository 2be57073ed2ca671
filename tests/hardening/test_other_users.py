"""Users sharing ``/dev/shm``: one user's objects, live or dead, real or planted, neither
block nor expose another user's pools; the sweep, ``lmpool ps`` and ``lmpool top`` skip
what they may not touch or cannot make sense of, and say so.

The other user is a subprocess that takes an unprivileged uid (``nobody``), so these tests
need root; they are skipped elsewhere."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import posix_ipc
import pytest

from lmpool_ipc import BoardWriter, IpcPool
from lmpool_ipc.lifecycle import pool_objects, unlink_object
from lmpool_ipc.names import new_pool_id
from lmpool_tools import ps, top

OTHER_UID = 65534
SCRIPT = Path(__file__).with_name("other_user.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def as_other_user(mode: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(OTHER_UID), mode, *args],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()



def _reaped_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def dead_pool_names(owner_pid: int) -> list[str]:
    """The four objects of one link and a state board, of a pool whose owner is dead."""
    prefix = f"/lmpool-{new_pool_id()}-{owner_pid}-{os.urandom(8).hex()}"
    return [f"{prefix}-ab", f"{prefix}-ba", f"/lmpool-{new_pool_id()}-{owner_pid}-board-state"]


@pytest.fixture
def cleanup():
    """Names to unlink after the test, whoever owns them (root may)."""
    names: list[str] = []
    yield names
    for obj in pool_objects():
        if obj.name in names:
            unlink_object(obj)


def test_a_dead_pool_of_another_user_does_not_stop_a_start(cleanup):
    """Root's dead pool in the sticky /dev/shm: the unprivileged user may not unlink it,
    and its pool start skips it instead of failing."""
    names = dead_pool_names(_reaped_pid())
    cleanup += names
    for name in names:
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o600, 4096).close_fd()
    assert as_other_user("start_pool") == "started"
    assert {o.name for o in pool_objects()} >= set(names), "another user's objects were removed"


def test_objects_planted_by_another_user_are_left_alone_and_logged(cleanup, caplog):
    names = dead_pool_names(_reaped_pid())
    cleanup += names
    assert as_other_user("plant", *names) == "planted"
    with caplog.at_level(logging.INFO, logger="lmpool_ipc.lifecycle"):
        IpcPool.start().close()
    assert {o.name for o in pool_objects()} >= set(names)
    assert "other users" in caplog.text and names[0] in caplog.text


def test_another_user_can_neither_open_nor_read_a_pool():
    with IpcPool.start() as pool:
        link = pool.create_link(capacity=4096)
        board = pool.create_board("state", 4096)
        assert as_other_user("open_end", link.b).startswith("refused")
        assert as_other_user("read_board", board).startswith("refused")
        listing = as_other_user("ps")
        assert listing.startswith("exit 0")
        assert f"{pool.pool_id:<32} {'?':>8} other user" in listing


def test_ps_and_top_survive_planted_boards(cleanup, caplog):
    """Fake state boards (garbage, empty, a valid header over garbage) are listed as
    invalid and logged, never a crash; ``top`` on one says what is wrong. One another user
    planted is listed as theirs, unread even by root (its owner could shrink it under the
    mapping)."""
    owner = _reaped_pid()
    theirs, garbage, empty, forged = (f"/lmpool-{new_pool_id()}-{owner}-board-state" for _ in range(4))
    cleanup += [theirs, garbage, empty, forged]
    as_other_user("plant", theirs)
    shm = posix_ipc.SharedMemory(garbage, posix_ipc.O_CREX, 0o600, 4096)
    os.write(shm.fd, os.urandom(4096))
    shm.close_fd()
    posix_ipc.SharedMemory(empty, posix_ipc.O_CREX, 0o644, 0).close_fd()
    # A real board's format around a value that is no pool state.
    assert IpcPool(forged.split("-")[1], owner).create_board("state", 4096) == forged
    with BoardWriter(forged) as writer:
        writer.publish(b"\xc1not msgpack")
    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="lmpool.ps"), contextlib.redirect_stdout(out):
        assert ps.main([]) == 0
    for name in (garbage, empty, forged):
        pool_id = name.split("-")[1]
        assert f"{pool_id:<32} {'?':>8} invalid" in out.getvalue()
        assert name in caplog.text
    assert f"{theirs.split('-')[1]:<32} {'?':>8} other user" in out.getvalue()
    for name in (theirs, garbage, forged):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert top.main([name.split("-")[1], "--once"]) == 1
        said = ["belongs to another user"] if name == theirs else ["no readable state board", "no valid pool state"]
        assert any(e in err.getvalue() for e in said), err.getvalue()
