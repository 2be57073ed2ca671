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
"""

import mmap
import time

import posix_ipc

from .errors import IpcError, RingCorruptError
from .ring import fence, write_header

MAGIC = b"LMPBOARD"
VERSION = 1
HEADER_SIZE = 64
READ_ATTEMPTS = 1000

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


class _Mapped:
    """A mapping of a board segment and u64 views of its header and data."""

    def __init__(self, name: str, writable: bool) -> None:
        self.name = name
        try:
            shm = posix_ipc.SharedMemory(name, read_only=not writable)
        except posix_ipc.PermissionsError as e:  # another user's: say so as Python does
            raise PermissionError(f"board {name} belongs to another user: {e}") from None
        try:
            if shm.size < HEADER_SIZE:  # planted, or not a board at all: nothing to map
                raise RingCorruptError(f"{name} is not an LMPool board: {shm.size} bytes, under a header")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(shm.fd, shm.size, prot=prot)
        finally:
            shm.close_fd()
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
        super().__init__(name, writable=True)
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
        super().__init__(name, writable=False)

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
