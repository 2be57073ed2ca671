"""A pool: the namespace of one LMPool instance's shared-memory objects, and its links.

The process that starts a pool owns it. ``IpcPool.start`` first sweeps the leftovers of
dead pools, then names a fresh pool; ``create_link`` creates the two rings and two
semaphores of one link (mode 0600, exclusive create), ``remove_link`` unlinks them once the
link is done with; ``create_board`` creates a board (see ``board``); ``close`` unlinks every
object of the pool, whichever process created it.
A link whose rings, with the pool's others, would exceed the whole shared-memory filesystem
(a container's 64 MB default) is refused, naming the sizes: it would fail later, with SIGBUS.
Links are opened by end name with ``Channel``, boards by name with ``BoardWriter`` and
``BoardReader``.

A started pool is closed however its owner lets go of it: ``close``, garbage collection
of the ``IpcPool``, interpreter exit (``weakref.finalize``), or SIGTERM, once
``close_on_sigterm`` is installed (``IpcPool.start`` installs it when on the main thread).
Only SIGKILL leaves objects behind, for the next start's sweep.
"""

import mmap
import os
import signal
import threading
import weakref
from contextlib import ExitStack
from dataclasses import dataclass

import posix_ipc

from .board import MAX_CAPACITY, board_bytes, format_board
from .errors import SharedMemoryTooSmallError
from .lifecycle import PoolObject, pool_objects, remove_pool, sweep_dead_pools, unlink_object
from .names import (
    BELL_ROLES,
    RING_ROLES,
    SHM_DIR,
    board_name,
    end_name,
    new_link_prefix,
    new_pool_id,
    object_name,
    parse_end,
    parse_object,
)
from .ring import format_ring, ring_bytes

DEFAULT_CAPACITY = 1 << 20
MODE = 0o600


@dataclass(frozen=True)
class Link:
    """The two end names of a link: give ``a`` to one process and ``b`` to the other."""

    a: str
    b: str


class IpcPool:
    """The shared-memory namespace of one pool, owned by process ``owner_pid``."""

    def __init__(self, pool_id: str, owner_pid: int) -> None:
        self.pool_id = pool_id
        self.owner_pid = owner_pid
        self._closer: weakref.finalize | None = None

    @classmethod
    def start(cls) -> "IpcPool":
        """Remove dead pools' leftovers, then start a new pool owned by this process; it is
        closed at the latest when it is garbage collected or the interpreter exits."""
        sweep_dead_pools()
        pool = cls(new_pool_id(), os.getpid())
        pool._closer = _closers[pool.pool_id] = weakref.finalize(pool, _close_pool, pool.pool_id)
        close_on_sigterm()
        return pool

    def create_link(self, capacity: int = DEFAULT_CAPACITY) -> Link:
        """Create a link whose two rings each hold ``capacity`` bytes of frames."""
        self._check_room(len(RING_ROLES) * ring_bytes(capacity))
        prefix = new_link_prefix(self.pool_id, self.owner_pid)
        with ExitStack() as undo:
            for role in RING_ROLES:
                name = object_name(prefix, role)
                _create_ring(name, capacity, self.owner_pid)
                undo.callback(_unlink, "shm", name)
            for role in BELL_ROLES:
                name = object_name(prefix, role)
                posix_ipc.Semaphore(name, posix_ipc.O_CREX, MODE, 0).close()
                undo.callback(_unlink, "sem", name)
            undo.pop_all()
        return Link(end_name(prefix, "a"), end_name(prefix, "b"))

    def remove_link(self, link: Link) -> list[str]:
        """Unlink ``link``'s rings and semaphores, once its processes are done with it (a
        channel still open on it keeps working until it closes); return the names removed."""
        prefix, _ = parse_end(link.a)
        named = [("shm", object_name(prefix, role)) for role in RING_ROLES]
        named += [("sem", object_name(prefix, role)) for role in BELL_ROLES]
        return [name for kind, name in named if _unlink(kind, name)]

    def _check_room(self, more: int) -> None:
        """Refuse ``more`` bytes of segments that, with this pool's own, exceed the size of the
        whole shared-memory filesystem. What other processes hold of it is not counted: it
        comes and goes."""
        try:
            fs = os.statvfs(SHM_DIR)
        except OSError:  # no such filesystem to look at: posix_ipc's own errors will say
            return
        size = fs.f_blocks * fs.f_frsize
        mine = sum(_size(o) for o in pool_objects() if o.parsed.pool_id == self.pool_id and o.kind == "shm")
        if mine + more > size:
            raise SharedMemoryTooSmallError(
                f"{SHM_DIR} holds {size / 2**20:.0f} MiB in all, and this pool's shared-memory rings would "
                f"take {(mine + more) / 2**20:.0f} MiB; give it more (a container: docker run --shm-size=1g, "
                f"or a Kubernetes emptyDir of medium Memory at {SHM_DIR}), or create fewer links")

    def create_board(self, label: str, capacity: int) -> str:
        """Create board ``label`` of this pool, holding values of up to ``capacity`` bytes;
        return its name. Only the owner's user can open it (mode 0600)."""
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"board capacity must be 1 to {MAX_CAPACITY} bytes (what readers open), got {capacity}")
        name = board_name(self.pool_id, self.owner_pid, label)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, MODE, board_bytes(capacity))
        try:
            with mmap.mmap(shm.fd, shm.size) as buf:
                format_board(buf, self.owner_pid)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        return name

    def close(self) -> list[str]:
        """Unlink every segment and semaphore of this pool; return their names. Channels
        still open keep working until they close."""
        if self._closer is not None:
            _closers.pop(self.pool_id, None)
            self._closer.detach()
        return remove_pool(self.pool_id)

    def __enter__(self) -> "IpcPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Pools of this process not yet closed, by id, for the SIGTERM handler.
_closers: dict[str, weakref.finalize] = {}


def _close_pool(pool_id: str) -> None:
    """A finalizer's body: it must not hold the pool, only its id."""
    _closers.pop(pool_id, None)
    remove_pool(pool_id)


def close_on_sigterm() -> bool:
    """From now on, SIGTERM closes this process's open pools before the process dies of it
    (as it would have: the default action runs again). Installed only over the default
    disposition, so an application's own handler stays; only the main thread can install
    it (elsewhere this does nothing). True if installed (now or before)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    if current is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum, frame) -> None:
    for closer in list(_closers.values()):
        closer()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of it, as without the handler


def _create_ring(name: str, capacity: int, owner_pid: int) -> None:
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, MODE, ring_bytes(capacity))
    try:
        with mmap.mmap(shm.fd, shm.size) as buf:
            format_ring(buf, owner_pid)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()


def _size(obj: PoolObject) -> int:
    """The bytes of a segment (0 if it is gone meanwhile)."""
    try:
        return os.stat(os.path.join(SHM_DIR, obj.name.lstrip("/"))).st_size
    except OSError:
        return 0


def _unlink(kind: str, name: str) -> bool:
    parsed = parse_object(name)
    assert parsed is not None  # a name object_name made
    return unlink_object(PoolObject(kind, name, parsed))
