"""Run as another user: ``python other_user.py UID MODE ARGS...``. Everything this script
needs is imported first, as the caller (the interpreter's own files may not be readable by
the other user), then the process takes ``UID`` and does ``MODE``; it prints one line."""

import contextlib
import io
import os
import shutil  # noqa: F401  (argparse imports it lazily, in lmpool ps)
import sys

import posix_ipc

from lmpool_ipc import BoardReader, IpcPool
from lmpool_ipc.endpoint import Endpoint
from lmpool_tools import ps


def start_pool() -> str:
    """Start a pool, make a link and close it: what a sweep that trips on others' objects broke."""
    with IpcPool.start() as pool:
        pool.create_link(capacity=4096)
    return "started"


def open_end(end: str) -> str:
    try:
        Endpoint(end)
    except (posix_ipc.PermissionsError, PermissionError) as e:
        return f"refused {type(e).__name__}"
    return "opened"


def read_board(name: str) -> str:
    try:
        BoardReader(name).read()
    except PermissionError as e:
        return f"refused {type(e).__name__}"
    return "read"


def run_ps() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ps.main([])
    return f"exit {code}\n{out.getvalue()}"


def plant(*names: str) -> str:
    """Create each name as a 0644 segment of garbage, as any user can."""
    for name in names:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o644, 4096)
        os.write(shm.fd, os.urandom(4096))
        shm.close_fd()
    return "planted"


MODES = {"start_pool": start_pool, "open_end": open_end, "read_board": read_board, "ps": run_ps, "plant": plant}

if __name__ == "__main__":
    uid, mode, *args = sys.argv[1:]
    os.setgid(int(uid))
    os.setuid(int(uid))
    print(MODES[mode](*args))
