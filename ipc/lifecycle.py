"""Process liveness, and removal of pools' shared-memory segments and semaphores.

POSIX shared memory outlives the processes that use it: a pool whose owner was killed
leaves its objects in ``/dev/shm`` until someone unlinks them. ``sweep_dead_pools`` (run
by ``IpcPool.start``) removes every object whose pool owner is gone; ``remove_pool``
removes one pool's objects at its orderly shutdown. Both find objects by name (see
``names``), so they also catch objects of links that were never fully opened.

Invariants: nothing of a pool whose owner is alive is ever removed by the sweeper. A
reused pid makes a dead pool look alive, which only delays its removal. Only objects of
this process's user are removed: ``/dev/shm`` is shared by every user and sticky, so an
object of another user (a pool of theirs, or a name planted to look like ours) is skipped
and logged, never an error that stops a pool from starting or closing.
"""

import logging
import os
import stat
from typing import NamedTuple

import posix_ipc

from .names import SEM_FILE_PREFIX, SHM_DIR, ObjectName, parse_object

log = logging.getLogger(__name__)

# Above any pid Linux hands out (pid_max is at most 2**22): a larger "pid", read from a
# name or a header someone else wrote, names no process and would overflow ``os.kill``.
PID_LIMIT = 1 << 30


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and has not exited. A zombie (exited, not yet reaped
    by its parent) counts as dead: it will never read or write a ring again."""
    if not 0 < pid < PID_LIMIT:
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
    """A segment (``kind == "shm"``) or semaphore (``"sem"``) of some pool, and the user
    that owns it (-1: not known)."""

    kind: str
    name: str
    parsed: ObjectName
    uid: int = -1

    @property
    def mine(self) -> bool:
        """True if this process's user owns the object (so may open and remove it)."""
        return self.uid == os.geteuid()


def pool_objects() -> list[PoolObject]:
    """Every regular file in ``/dev/shm`` named like a pool's object, of any pool and any
    user. Anything else under such a name (a directory, a link) was planted: skipped."""
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
        if parsed is None:
            continue
        try:
            info = os.lstat(os.path.join(SHM_DIR, entry))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if not stat.S_ISREG(info.st_mode):
            log.warning("skipping %s/%s: named like an LMPool object but not a regular file", SHM_DIR, entry)
            continue
        found.append(PoolObject(kind, "/" + bare, parsed, info.st_uid))
    return found


def boards(label: str) -> list[PoolObject]:
    """Every board named ``label``, of any pool and any owner."""
    return [o for o in pool_objects() if o.parsed.board == label]


def unlink_object(obj: PoolObject) -> bool:
    """Unlink one object; False if it was already gone (someone else removed it) or may
    not be removed by this user (logged)."""
    try:
        if obj.kind == "sem":
            posix_ipc.unlink_semaphore(obj.name)
        else:
            posix_ipc.unlink_shared_memory(obj.name)
    except posix_ipc.ExistentialError:
        return False
    except (posix_ipc.PermissionsError, PermissionError):
        log.warning("skipping %s %s: this user may not remove it", obj.kind, obj.name)
        return False
    return True


def _ours(objects: list[PoolObject]) -> list[PoolObject]:
    """The objects of this process's user; the others are logged and left alone."""
    theirs = [o.name for o in objects if not o.mine]
    if theirs:
        log.info("leaving %d object(s) of other users alone: %s", len(theirs), ", ".join(sorted(theirs)[:8]))
    return [o for o in objects if o.mine]


def remove_pool(pool_id: str) -> list[str]:
    """Unlink every object of pool ``pool_id``; return the names removed. Processes that
    still have them open keep working; the memory is freed when the last one closes."""
    objects = [o for o in pool_objects() if o.parsed.pool_id == pool_id]
    return [o.name for o in _ours(objects) if unlink_object(o)]


def sweep_dead_pools() -> list[str]:
    """Unlink every object of this user's pools whose owner process is gone; return the
    names. Other users' objects are skipped (and logged): they are theirs to sweep."""
    alive: dict[int, bool] = {}
    removed = []
    for obj in _ours(pool_objects()):
        pid = obj.parsed.owner_pid
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        if not alive[pid] and unlink_object(obj):
            removed.append(obj.name)
    return removed
