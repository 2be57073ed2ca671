"""What anyone can leave under a board's name in ``/dev/shm`` instead of a board, for the tests
that readers refuse it at once: ``plant`` makes one, ``remove`` takes it away, and
``fifo_guard`` lets go of a reader that a regression left blocked opening a FIFO.

The guard is a process, not a thread: a blocked open may hold the GIL (``posix_ipc``'s
``shm_open`` does), and then no thread of the test runs again."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
from pathlib import Path

from lmpool_ipc.board import HEADER_SIZE, format_board

KINDS = ("fifo", "link", "directory", "empty", "short")
GUARD_S = 60  # a safety net for a regression only: a non-blocking open returns at once


def plant(kind: str, path: Path, link_to: str = "/dev/null") -> None:
    """Put a ``kind`` (one of ``KINDS``) at ``path``, readable by this user only."""
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link":
        path.symlink_to(link_to)
    elif kind == "directory":
        path.mkdir(0o700)
    else:
        write_board(path, 0 if kind == "empty" else HEADER_SIZE - 1)


def write_board(path: Path, size: int, mode: int = 0o600) -> None:
    """A file at ``path`` of ``size`` bytes in all, formatted as a board if it holds a header."""
    with open(path, "xb") as f:
        f.truncate(size)  # sparse on tmpfs: a large one costs nothing
    path.chmod(mode)  # as given, whatever the umask
    if size >= HEADER_SIZE:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as buf:
            format_board(buf, os.getpid())


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def fifo_guard(path: Path):
    """Around reads of the FIFO at ``path``: after ``GUARD_S`` a helper opens its writing end
    for each reader blocked opening it, which releases that reader; the test then fails,
    saying so."""
    release = 'sleep "$0"; while exec 3>"$1"; do exec 3>&-; echo released; sleep 1; done'
    # Its own process group, so that killing it also ends its ``sleep``, which holds the pipe.
    guard = subprocess.Popen(["sh", "-c", release, str(GUARD_S), str(path)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(guard.pid, signal.SIGKILL)
        released = guard.communicate()[0]
    assert "released" not in released, f"opening {path} blocked until the guard opened its other end"
