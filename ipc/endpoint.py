"""One end of a link, open in this process.

An end produces into one ring and consumes from the other, sleeps on its own semaphore
and posts the peer's. Opening an end records this process's pid in both rings (the peer
uses it to notice our death); closing it marks both rings closed for the peer, wakes the
peer so it notices, and unmaps everything. Unlinking the names is the pool's business.

Invariants: at most one process has an end open, so each ring has one producer and one
consumer; an end that was closed stays closed (the peer has seen it go).
"""

import mmap
import os
import time
from contextlib import ExitStack

import posix_ipc

from .errors import ChannelClosedError, IpcError, RingCorruptError
from .lifecycle import pid_alive
from .names import ENDS, object_name, parse_end
from .ring import MIN_CAPACITY, Ring, ring_bytes

# Ends open in this process: a second open of one of them is refused like one elsewhere.
_open_here: set[str] = set()


class Endpoint:
    """The rings and semaphores of one end of a link, mapped into this process."""

    def __init__(self, end: str) -> None:
        prefix, side = parse_end(end)
        peer = ENDS[1 - ENDS.index(side)]
        self.name = end
        with ExitStack() as undo:
            try:
                self.tx, tx_map = _map_ring(object_name(prefix, side + peer), undo)
                self.rx, rx_map = _map_ring(object_name(prefix, peer + side), undo)
                self.bell = posix_ipc.Semaphore(object_name(prefix, side))
                undo.callback(self.bell.close)
                self.peer_bell = posix_ipc.Semaphore(object_name(prefix, peer))
                undo.callback(self.peer_bell.close)
            except posix_ipc.ExistentialError:
                raise ChannelClosedError(
                    f"link end {end!r} does not exist (its pool was closed or swept)"
                ) from None
            holder = self.tx.producer_pid
            if end in _open_here or (holder != os.getpid() and pid_alive(holder)):
                raise IpcError(f"link end {end!r} is already open in process {holder}")
            if self.tx.producer_closed:
                raise ChannelClosedError(f"link end {end!r} was closed; ends do not reopen")
            self._maps = (tx_map, rx_map)
            undo.pop_all()
        _open_here.add(end)
        self.tx.producer_pid = os.getpid()
        self.rx.consumer_pid = os.getpid()
        self.beat()

    @property
    def peer_pid(self) -> int:
        """The pid of the process that opened the other end; 0 until it has."""
        return self.rx.producer_pid

    def beat(self) -> None:
        """Tell the peer we are alive (see ``Channel``'s ``heartbeat_timeout``)."""
        self.tx.producer_beat_ns = time.monotonic_ns()

    def wake_peer(self) -> None:
        self.peer_bell.release()

    def close(self) -> None:
        """Mark both rings closed for the peer, wake it, and unmap. Call once, after every
        thread of this process has stopped using the end."""
        self.tx.close_producer()
        self.rx.close_consumer()
        self.peer_bell.release()
        for ring, buf in zip((self.tx, self.rx), self._maps):
            ring.release()
            buf.close()
        self.bell.close()
        self.peer_bell.close()
        _open_here.discard(self.name)


def _map_ring(name: str, undo: ExitStack) -> tuple[Ring, mmap.mmap]:
    shm = posix_ipc.SharedMemory(name)
    try:
        if shm.size < ring_bytes(MIN_CAPACITY):  # not a ring this format made
            raise RingCorruptError(f"{name} is not an LMPool ring: {shm.size} bytes")
        buf = mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()
    undo.callback(buf.close)
    ring = Ring(buf)
    undo.callback(ring.release)
    return ring, buf
