"""One single-producer/single-consumer ring of frames laid out in a shared buffer: four 64-byte
header lines (fixed: magic, version, capacity, owner pid; the producer's ``tail``; the consumer's
``head``; wait flags, pids, heartbeat, closed flags), then ``capacity`` bytes of frames. Why this
layout and how wakeups are never lost: docs/ARCHITECTURE.md, "IPC".

Invariants: only the producer stores ``tail`` and only the consumer stores ``head``;
``0 <= tail - head <= capacity``; both are multiples of ``ALIGN``; ``[head, tail)`` holds complete
frames; a side sleeps only after declaring it and re-checking the other's index behind a fence,
and the other side posts only to a declared sleeper.
"""

import threading

from .errors import RingCorruptError
from .frames import ALIGN, frame_size, read_frame, write_frame

MAGIC = b"LMPRING\x00"
VERSION = 1
HEADER_SIZE = 256
MIN_CAPACITY = 64

# Word indices into the header (word 0 holds MAGIC).
_VERSION, _CAPACITY, _OWNER_PID = 1, 2, 3
_TAIL = 8
_HEAD = 16
_PRODUCER_WAIT, _CONSUMER_WAIT, _PRODUCER_PID, _CONSUMER_PID = 24, 25, 26, 27
_PRODUCER_BEAT, _PRODUCER_CLOSED, _CONSUMER_CLOSED = 28, 29, 30

_fence_lock = threading.Lock()


def fence() -> None:
    """Full memory barrier between the loads and stores before and after it.

    Python has no memory model: nothing stops the CPU from making our tail store
    visible to the other process before the payload stores it publishes, or from
    performing a load of the other side's index before our own store (the store->load
    reordering that breaks the wakeup handshake). A lock acquire/release is a real
    barrier: CPython implements ``threading.Lock`` with a glibc semaphore whose fast
    paths are atomic read-modify-writes, and on x86-64 every such locked instruction is
    a full fence that no load or store crosses in either direction. (The C compiler
    cannot move memory accesses across these opaque calls either.) ~100 ns a pair.
    LMPool's hosts are x86-64; on a weakly ordered CPU (aarch64) glibc's semaphore
    operations are only acquire/release, and this would have to become a real fence.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def ring_bytes(capacity: int) -> int:
    """Size of the shared buffer that holds a ring of ``capacity`` data bytes."""
    return HEADER_SIZE + capacity


def format_ring(buf, owner_pid: int) -> None:
    """Write a fresh header into ``buf`` (all of it becomes header + data)."""
    capacity = len(buf) - HEADER_SIZE
    if capacity < MIN_CAPACITY or capacity % ALIGN:
        raise ValueError(
            f"ring capacity must be a multiple of {ALIGN} and at least {MIN_CAPACITY}, "
            f"got {capacity}"
        )
    write_header(buf, HEADER_SIZE, MAGIC, VERSION, owner_pid)


def write_header(buf, header_size: int, magic: bytes, version: int, owner_pid: int) -> None:
    """Zero ``buf``'s header and fill its first line, which rings and boards share: magic,
    format version, capacity (the bytes after the header), owner pid. The magic goes in
    last, so that whoever sees it sees the rest."""
    with memoryview(buf) as view, view[:header_size].cast("Q") as words:
        words[:] = memoryview(bytes(header_size)).cast("Q")
        words[_VERSION] = version
        words[_CAPACITY] = len(buf) - header_size
        words[_OWNER_PID] = owner_pid
        fence()  # a reader that sees the magic sees the complete header
        view[:8] = magic


class Ring:
    """A view of a formatted ring in ``buf``; one process is its producer, one its consumer.

    Header words are read and written through a memoryview cast to u64: an item access
    copies 8 aligned bytes with a fixed-size memcpy, i.e. one load or store, so an index
    is never seen half-written (``struct``'s standard sizes would go byte by byte).
    """

    def __init__(self, buf) -> None:
        self._view = memoryview(buf)
        self._words = self._view[:HEADER_SIZE].cast("Q")
        self._data = self._view[HEADER_SIZE:]
        if self._view[:8] != MAGIC:
            self.release()
            raise RingCorruptError("not an LMPool ring: bad magic")
        if self._words[_VERSION] != VERSION:
            version = self._words[_VERSION]
            self.release()
            raise RingCorruptError(f"ring format version {version}, expected {VERSION}")
        self.capacity = self._words[_CAPACITY]
        # Each side keeps its own index (it is its only writer) and the last value it read
        # of the other side's (see above).
        self._head = self._seen_head = self._words[_HEAD]
        self._tail = self._seen_tail = self._words[_TAIL]
        if self.capacity != len(self._data):
            self.release()
            raise RingCorruptError(
                f"ring header says capacity {self.capacity} but the buffer holds "
                f"{len(buf) - HEADER_SIZE} data bytes"
            )

    def release(self) -> None:
        """Drop the views into ``buf`` so that its owner can close it."""
        for view in (self._words, self._data, self._view):
            view.release()

    # Identity and liveness fields ------------------------------------------------

    @property
    def owner_pid(self) -> int:
        return self._words[_OWNER_PID]

    @property
    def producer_pid(self) -> int:
        return self._words[_PRODUCER_PID]

    @producer_pid.setter
    def producer_pid(self, pid: int) -> None:
        self._words[_PRODUCER_PID] = pid

    @property
    def consumer_pid(self) -> int:
        return self._words[_CONSUMER_PID]

    @consumer_pid.setter
    def consumer_pid(self, pid: int) -> None:
        self._words[_CONSUMER_PID] = pid

    @property
    def producer_beat_ns(self) -> int:
        """CLOCK_MONOTONIC time of the producer's last heartbeat (0: none yet)."""
        return self._words[_PRODUCER_BEAT]

    @producer_beat_ns.setter
    def producer_beat_ns(self, ns: int) -> None:
        self._words[_PRODUCER_BEAT] = ns

    @property
    def producer_closed(self) -> bool:
        return bool(self._words[_PRODUCER_CLOSED])

    def close_producer(self) -> None:
        fence()  # every frame published before the close is visible with it
        self._words[_PRODUCER_CLOSED] = 1

    @property
    def consumer_closed(self) -> bool:
        return bool(self._words[_CONSUMER_CLOSED])

    def close_consumer(self) -> None:
        self._words[_CONSUMER_CLOSED] = 1

    # Indices ---------------------------------------------------------------------

    @property
    def head(self) -> int:
        return self._words[_HEAD]

    @property
    def tail(self) -> int:
        return self._words[_TAIL]

    def used(self) -> int:
        return self._words[_TAIL] - self._words[_HEAD]

    def free(self) -> int:
        return self.capacity - (self._words[_TAIL] - self._words[_HEAD])

    # Producer side ---------------------------------------------------------------

    def try_put(self, payload) -> bool:
        """Append one frame and publish it; False (nothing written) if it does not fit now.
        The caller has checked that ``len(payload) <= max_payload(capacity)``."""
        tail = self._tail
        size = frame_size(len(payload))
        if size > self.capacity - (tail - self._seen_head):
            self._seen_head = self._words[_HEAD]
            if size > self.capacity - (tail - self._seen_head):
                return False
            fence()  # the head load completes before we overwrite the space it handed back
        write_frame(self._data, tail, payload)
        fence()  # the payload is visible before the tail store that publishes it
        self._words[_TAIL] = self._tail = tail + size
        return True

    def take_consumer_wakeup(self) -> bool:
        """After publishing: True if the consumer declared itself asleep (the caller posts
        its semaphore); the declaration is consumed."""
        fence()  # our tail store is ordered before this load of the consumer's flag
        if self._words[_CONSUMER_WAIT]:
            self._words[_CONSUMER_WAIT] = 0
            return True
        return False

    def park_producer(self, need: int) -> bool:
        """Declare that the producer sleeps until ``need`` bytes are free. False (and the
        declaration withdrawn) if they already are."""
        self._words[_PRODUCER_WAIT] = need
        fence()  # the flag store is ordered before the head load below
        if self.free() >= need:
            self._words[_PRODUCER_WAIT] = 0
            return False
        return True

    def unpark_producer(self) -> None:
        self._words[_PRODUCER_WAIT] = 0

    # Consumer side ---------------------------------------------------------------

    def take(self) -> bytes | None:
        """Copy out the oldest published frame and hand its space back; None if empty."""
        head = self._head
        if head == self._seen_tail:
            self._seen_tail = self._words[_TAIL]
            if head == self._seen_tail:
                return None
            fence()  # the payload loads happen after the tail load that published them
        payload, head = read_frame(self._data, head, self._seen_tail - head)
        fence()  # the payload loads complete before the head store frees their space
        self._words[_HEAD] = self._head = head
        return payload

    def take_producer_wakeup(self) -> bool:
        """After freeing space: True if the producer sleeps and its need is now met (the
        caller posts its semaphore); the declaration is consumed."""
        fence()  # our head store is ordered before this load of the producer's flag
        need = self._words[_PRODUCER_WAIT]
        if need and self.free() >= need:
            self._words[_PRODUCER_WAIT] = 0
            return True
        return False

    def park_consumer(self) -> bool:
        """Declare that the consumer sleeps until a frame is published. False (and the
        declaration withdrawn) if one already is."""
        self._words[_CONSUMER_WAIT] = 1
        fence()  # the flag store is ordered before the tail load below
        if self._words[_TAIL] != self._words[_HEAD]:
            self._words[_CONSUMER_WAIT] = 0
            return False
        return True

    def unpark_consumer(self) -> None:
        self._words[_CONSUMER_WAIT] = 0
