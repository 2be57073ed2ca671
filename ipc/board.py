"""A board: a named shared-memory region of a pool where one writer publishes a byte string
and any number of readers take its latest value, without ever making the writer wait.

Layout: one 64-byte line of native-endian u64 words, then ``capacity`` data bytes.

    line 0:  magic, format version, capacity, owner pid, sequence, length
    data:    the latest published value, ``length`` bytes

Seqlock. The writer stores an odd ``sequence``, writes ``length`` and the data, then stores
the next even ``sequence``. A reader loads ``sequence`` (odd: a write is under way, try
again), copies ``length`` and the data, and loads ``sequence`` again; the copy is the
published value only if both loads saw the same even number. Readers store nothing and map
the region read-only, so any number of them, slow or dead, can neither block nor disturb the
writer; a reader that keeps losing the race gives up after a bounded number of tries.

Invariants: one writer at a time (the process its user appoints); ``sequence`` is even
outside ``publish``, grows by 2 per publish, and 0 means nothing published yet; the data
region holds a complete value whenever ``sequence`` is even.

The segment is named by the pool (``names.board_name``), so ``IpcPool.close`` and the sweeper
remove it with the pool's links.

Opening. Anyone can plant a file under a board's name, or swap one in after it was listed, so
a reader opens the name without blocking and without following links, and maps only a
regular file of its own user, writable by no one else, of a header's size to
``MAX_CAPACITY``: a FIFO would block the open, and a file its owner can shrink under the
mapping would kill the reader with SIGBUS. A writer opens through ``posix_ipc``.
"""

import errno
import mmap
import os
import stat
import time

import posix_ipc

from .errors import IpcError, RingCorruptError
from .names import SHM_DIR
from .ring import fence, write_header

MAGIC = b"LMPBOARD"
VERSION = 1
HEADER_SIZE = 64
READ_ATTEMPTS = 1000
# The largest board a reader maps: far above any board this package's users create, and a
# bound on what a planted file of any size can make a reader map and copy.
MAX_CAPACITY = 1 << 26

# Word indices into the header; words 0-3 as in a ring (``ring.write_header`` fills them).
_VERSION, _CAPACITY, _OWNER_PID, _SEQUENCE, _LENGTH = 1, 2, 3, 4, 5


class BoardBusyError(IpcError):
    """No consistent value could be read: the writer was mid-write at every try (or died
    while writing)."""


def board_bytes(capacity: int) -> int:
    return HEADER_SIZE + capacity


def format_board(buf, owner_pid: int) -> None:
    """Write a fresh header into ``buf`` (all of it becomes header + data)."""
    write_header(buf, HEADER_SIZE, MAGIC, VERSION, owner_pid)


def _map_to_write(name: str) -> mmap.mmap:
    """The writer's read-write mapping of segment ``name``, through ``posix_ipc``."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.PermissionsError as e:  # another user's: say so as Python does
        raise PermissionError(f"board {name} belongs to another user: {e}") from None
    try:
        if shm.size < HEADER_SIZE:  # planted, or not a board at all: nothing to map
            raise RingCorruptError(f"{name} is not an LMPool board: {shm.size} bytes, under a header")
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def _map_to_read(name: str) -> mmap.mmap:
    """A read-only mapping of segment ``name``, opened without blocking; raises
    ``RingCorruptError`` saying why for anything but a plausible board of this user's, and
    ``PermissionError`` for another user's."""
    if not name.startswith("/") or "/" in name[1:] or name in ("/", "/.", "/.."):
        raise ValueError(f"not a shared-memory name: {name!r}")
    try:
        # O_NONBLOCK: a FIFO swapped in after the listing opens at once instead of waiting
        # for a writer; O_NOFOLLOW: a symbolic link fails instead of opening its target.
        fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError as e:
        raise PermissionError(f"board {name} belongs to another user: {e}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RingCorruptError(f"{name} is not an LMPool board: a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)  # of what was opened, whatever the name holds by now
        _check_segment(name, info)
        return mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _check_segment(name: str, info: os.stat_result) -> None:
    """Raise unless ``info`` is of a file a reader may map as a board (see the module)."""
    if not stat.S_ISREG(info.st_mode):
        raise RingCorruptError(f"{name} is not an LMPool board: not a regular file ({stat.filemode(info.st_mode)})")
    if info.st_uid != os.geteuid():  # also for root: its owner could shrink it under the mapping
        raise PermissionError(f"board {name} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RingCorruptError(f"{name} is not an LMPool board: other users may write it")
    if info.st_size < HEADER_SIZE:
        raise RingCorruptError(f"{name} is not an LMPool board: {info.st_size} bytes, under a header")
    if info.st_size > board_bytes(MAX_CAPACITY):
        raise RingCorruptError(f"{name} is not an LMPool board: {info.st_size} bytes, over {board_bytes(MAX_CAPACITY)}")


class _Mapped:
    """A mapping of a board segment and u64 views of its header and data."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self._map = buf
        self._view = memoryview(self._map)
        self._words = self._view[:HEADER_SIZE].cast("Q")
        self._data = self._view[HEADER_SIZE:]
        if self._view[:8] != MAGIC or self._words[_VERSION] != VERSION:
            self.close()
            raise RingCorruptError(f"{name} is not an LMPool board of format version {VERSION}")
        self.capacity = self._words[_CAPACITY]
        if self.capacity != len(self._data):
            self.close()
            raise RingCorruptError(f"{name}: header says capacity {self.capacity}, segment holds {len(self._data)}")

    @property
    def owner_pid(self) -> int:
        return self._words[_OWNER_PID]

    @property
    def sequence(self) -> int:
        return self._words[_SEQUENCE]

    def close(self) -> None:
        for view in (self._words, self._data, self._view):
            view.release()
        self._map.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BoardWriter(_Mapped):
    """The one process that publishes on a board."""

    def __init__(self, name: str) -> None:
        super().__init__(name, _map_to_write(name))
        # A writer that died mid-write left an odd sequence: continue from the next even one.
        sequence = self._words[_SEQUENCE]
        self._sequence = sequence + (sequence & 1)

    def publish(self, value: bytes) -> None:
        """Replace the board's value. Never waits for readers."""
        if len(value) > self.capacity:
            raise ValueError(f"a {len(value)}-byte value does not fit a board of {self.capacity} bytes")
        self._words[_SEQUENCE] = self._sequence + 1
        # Python has no memory model: nothing else stops the CPU from making data stores
        # visible before the odd sequence, or the even sequence before the data. A lock
        # acquire/release is a full barrier (see ``ring.fence``), so a reader that sees
        # the even sequence again after its copy knows no byte it copied was changing.
        fence()
        self._words[_LENGTH] = len(value)
        self._data[: len(value)] = value
        fence()
        self._sequence += 2
        self._words[_SEQUENCE] = self._sequence


class BoardReader(_Mapped):
    """A read-only view of a board; any number of processes may read at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name, _map_to_read(name))

    def read(self) -> bytes | None:
        """The latest published value; None if nothing has been published yet."""
        for attempt in range(READ_ATTEMPTS):
            sequence = self._words[_SEQUENCE]
            if not sequence & 1:
                # The barriers keep the data loads between the two sequence loads.
                fence()
                length = self._words[_LENGTH]
                value = bytes(self._data[:length]) if length <= self.capacity else None
                fence()
                if self._words[_SEQUENCE] == sequence and value is not None:
                    return value if sequence else None
            if attempt % 10 == 9:
                time.sleep(0.0001)  # a slow writer: let it finish rather than spin
        raise BoardBusyError(f"board {self.name} was being written at every one of {READ_ATTEMPTS} tries")
