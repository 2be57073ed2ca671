"""Boards (lmpool_ipc.board): a reader sees the latest value whole, never a torn one, while
another process publishes as fast as it can; board names; a board goes with its pool; a
reader refuses, at once, whatever else is under a board's name (a FIFO, a link, a directory,
a file of the wrong size, mode or owner)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ipc_testkit import board_value, check_board_value, leftovers
from planted import fifo_guard, plant, remove, write_board
from waiting import wait_until

from lmpool_ipc import BoardBusyError, BoardReader, BoardWriter, IpcPool, RingCorruptError, boards
from lmpool_ipc.board import _SEQUENCE, MAX_CAPACITY, board_bytes
from lmpool_ipc.names import SHM_DIR, board_name, new_pool_id, parse_object

PEER = Path(__file__).with_name("ipc_peer.py")


def peer(mode: str, *args: str, **popen_kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), "asyncio", mode, *args], **popen_kwargs)


def test_publish_and_read(pool):
    name = pool.create_board("state", 1024)
    with BoardWriter(name) as writer, BoardReader(name) as reader:
        assert reader.read() is None  # nothing published yet
        assert reader.owner_pid == os.getpid() and reader.capacity == 1024
        writer.publish(b"hello board")
        assert reader.read() == b"hello board"
        writer.publish(b"hi")  # shorter than the value before
        assert reader.read() == b"hi"
        writer.publish(b"")
        assert reader.read() == b""
        assert reader.sequence == 6  # two per publish, even between them
        with pytest.raises(ValueError, match="does not fit a board of 1024 bytes"):
            writer.publish(bytes(1025))
        writer.publish(bytes(1024))  # exactly full
        assert reader.read() == bytes(1024)


def test_only_the_owner_can_open_it_and_readers_cannot_write(pool):
    name = pool.create_board("state", 64)
    assert os.stat(f"/dev/shm{name}").st_mode & 0o777 == 0o600
    with BoardReader(name) as reader:
        with pytest.raises(TypeError):  # the mapping is read-only
            reader._data[0] = 1


def test_no_torn_reads_while_another_process_publishes(pool):
    name = pool.create_board("state", 8 * 500)
    writer = peer("publish", name)
    try:
        with BoardReader(name) as reader:
            seen = [0]
            busy = 0

            def read_once() -> bool:
                nonlocal busy
                try:
                    value = reader.read()
                except BoardBusyError:  # back-to-back writes can outrun a reader: no harm
                    busy += 1
                    return False
                if value is not None and check_board_value(value) != seen[-1]:
                    seen.append(check_board_value(value))
                return len(seen) == 200

            # Read without pausing: the reads race the writer, which is what the test is after.
            wait_until(read_once, "200 distinct values", limit=60, interval=0,
                       show=lambda: f"{len(seen)} values read, {busy} reads gave up")
    finally:
        writer.kill()
        writer.wait()
    assert seen == sorted(seen), "a reader never goes back in time"


def test_a_writer_that_died_mid_write(pool):
    name = pool.create_board("state", 64)
    with BoardWriter(name) as writer:
        writer.publish(board_value(1))
        writer._words[_SEQUENCE] += 1  # what a writer killed between its two stores leaves
    with BoardReader(name) as reader:
        with pytest.raises(BoardBusyError, match="being written"):
            reader.read()
        with BoardWriter(name) as successor:
            successor.publish(board_value(2))
        assert check_board_value(reader.read()) == 2
        assert reader.sequence % 2 == 0


def test_not_a_board(pool):
    link = pool.create_link()
    ring = link.a.split(":")[0] + "-ab"
    with pytest.raises(RingCorruptError, match="not an LMPool board"):
        BoardReader(ring)


def test_board_names():
    pool_id = "0123456789abcdef" * 2
    name = board_name(pool_id, 42, "state")
    assert name == f"/lmpool-{pool_id}-42-board-state"
    parsed = parse_object(name)
    assert (parsed.pool_id, parsed.owner_pid, parsed.board, parsed.link_id, parsed.role) == (
        pool_id, 42, "state", "", ""
    )
    assert parse_object(f"/lmpool-{pool_id}-42-{'ab' * 8}-ab").board == ""
    for bad in ("", "State", "9lives", "a-b", "x" * 17):
        with pytest.raises(ValueError, match="board label"):
            board_name(pool_id, 42, bad)


def test_pool_close_removes_its_board():
    pool = IpcPool.start()
    name = pool.create_board("state", 64)
    assert [b.name for b in boards("state") if b.parsed.pool_id == pool.pool_id] == [name]
    with BoardReader(name) as reader:
        assert pool.close() == [name]
        assert reader.read() is None  # an open mapping outlives the name
    assert leftovers(pool.pool_id) == []


def test_a_dead_pools_board_is_swept_and_a_live_ones_is_not(pool):
    pool.create_board("state", 64)
    crashed = peer("crash-board", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        crashed_pool = crashed.stdout.readline().strip()
        assert len(leftovers(crashed_pool)) == 1
    finally:
        crashed.kill()
        crashed.wait()
        crashed.stdin.close()
        crashed.stdout.close()
    with IpcPool.start():
        assert leftovers(crashed_pool) == []
        assert len(leftovers(pool.pool_id)) == 1


# ---- what else may be under a board's name -------------------------------------------------


@pytest.fixture
def planted():
    """A board name of no pool, and its path, cleared after the test whatever it became."""
    name = board_name(new_pool_id(), os.getpid(), "state")
    path = Path(SHM_DIR + name)
    yield name, path
    remove(path)


def refusal(name: str) -> Exception:
    """What ``BoardReader(name)`` raised; the test fails if it opened."""
    try:
        BoardReader(name).close()
    except Exception as e:
        return e
    pytest.fail(f"{name} opened as a board")


def test_a_fifo_is_refused_at_once_not_waited_on(planted):
    """A FIFO swapped in for a board after ``lmpool ps`` listed it hung the open until a writer came."""
    name, path = planted
    plant("fifo", path)
    with fifo_guard(path):
        refused = refusal(name)
    assert isinstance(refused, RingCorruptError) and "not a regular file" in str(refused)


@pytest.mark.parametrize("kind, why", [("link", "symbolic link"), ("directory", "not a regular file"),
                                       ("empty", "0 bytes, under a header"), ("short", "63 bytes, under a header")])
def test_what_else_is_under_a_boards_name_is_refused(pool, planted, kind, why):
    name, path = planted
    plant(kind, path, link_to=SHM_DIR + pool.create_board("state", 64))  # a link even to a real board
    refused = refusal(name)
    assert isinstance(refused, RingCorruptError) and why in str(refused)


def test_a_file_over_the_largest_board_is_refused(planted):
    name, path = planted
    write_board(path, board_bytes(MAX_CAPACITY) + 1)
    assert f"bytes, over {board_bytes(MAX_CAPACITY)}" in str(refusal(name))


def test_a_file_others_may_write_is_refused(planted):
    """Whoever may write a board may also shrink it under a reader's mapping: SIGBUS."""
    name, path = planted
    write_board(path, board_bytes(64), mode=0o620)
    refused = refusal(name)
    assert isinstance(refused, RingCorruptError) and "other users may write it" in str(refused)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_board_is_not_mapped_even_by_root(planted):
    name, path = planted
    write_board(path, board_bytes(64))
    os.chown(path, 65534, 65534)  # nobody, who could shrink it under root's mapping
    refused = refusal(name)
    assert isinstance(refused, PermissionError) and "another user" in str(refused)


def test_a_file_shaped_like_a_board_is_read(planted):
    """The checks refuse what is no board, not a board made by other means than a pool's."""
    name, path = planted
    write_board(path, board_bytes(64))
    with BoardReader(name) as reader:
        assert reader.read() is None and reader.capacity == 64 and reader.owner_pid == os.getpid()


def test_a_name_that_is_no_shared_memory_name_is_refused():
    for bad in ("lmpool-x", "/../etc/passwd", "/a/b", "/", "/.."):
        with pytest.raises(ValueError, match="not a shared-memory name"):
            BoardReader(bad)
