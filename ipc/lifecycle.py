"""Process liveness, and removal of pools' shared-memory segments and semaphores.

POSIX shared memory outlives the processes that use it: a pool whose owner was killed
leaves its objects in ``/dev/shm`` until someone unlinks them. ``sweep_dead_pools`` (run
by ``IpcPool.start``) removes every object whose pool owner is gone; ``remove_pool``
removes one pool's objects at its orderly shutdown. Both find objects by name (see
``names``), so they also catch objects of links that were never fully opened.

Invariant: nothing of a pool whose owner is alive is ever removed by the sweeper. A
reused pid makes a dead pool look alive, which only delays its removal.
"""

import os
from typing import NamedTuple

import posix_ipc

from .names import SEM_FILE_PREFIX, SHM_DIR, ObjectName, parse_object


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and has not exited. A zombie (exited, not yet reaped
    by its parent) counts as dead: it will never read or write a ring again."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists but belongs to another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The state letter follows the command name, which is in parentheses and may
    # itself contain ") ".
    after_name = stat.rindex(b")") + 2
    return stat[after_name : after_name + 1] not in (b"Z", b"X")


class PoolObject(NamedTuple):
    """A segment (``kind == "shm"``) or semaphore (``"sem"``) of some pool."""

    kind: str
    name: str
    parsed: ObjectName


def pool_objects() -> list[PoolObject]:
    """Every object in ``/dev/shm`` named like a pool's, of any pool and any owner."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        if entry.startswith(SEM_FILE_PREFIX):
            kind, bare = "sem", entry[len(SEM_FILE_PREFIX) :]
        else:
            kind, bare = "shm", entry
        parsed = parse_object(bare)
        if parsed is not None:
            found.append(PoolObject(kind, "/" + bare, parsed))
    return found


def boards(label: str) -> list[PoolObject]:
    """Every board named ``label``, of any pool and any owner."""
    return [o for o in pool_objects() if o.parsed.board == label]


def unlink_object(obj: PoolObject) -> bool:
    """Unlink one object; False if it was already gone (someone else removed it)."""
    try:
        if obj.kind == "sem":
            posix_ipc.unlink_semaphore(obj.name)
        else:
            posix_ipc.unlink_shared_memory(obj.name)
    except posix_ipc.ExistentialError:
        return False
    return True


def remove_pool(pool_id: str) -> list[str]:
    """Unlink every object of pool ``pool_id``; return the names removed. Processes that
    still have them open keep working; the memory is freed when the last one closes."""
    return [o.name for o in pool_objects() if o.parsed.pool_id == pool_id and unlink_object(o)]


def sweep_dead_pools() -> list[str]:
    """Unlink every object of every pool whose owner process is gone; return the names."""
    alive: dict[int, bool] = {}
    removed = []
    for obj in pool_objects():
        pid = obj.parsed.owner_pid
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        if not alive[pid] and unlink_object(obj):
            removed.append(obj.name)
    return removed
