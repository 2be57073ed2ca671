"""Asyncio channel of typed msgspec messages over one end of a link: ``send`` appends one
msgpack frame, waiting while the ring is full; ``recv`` returns the next message decoded as the
channel's type. A side with nothing to do spins briefly, then parks on a helper thread's
semaphore wait (docs/ARCHITECTURE.md, "IPC").

Invariants: messages arrive in order, each once. A peer that exited, closed its end, or (with
``heartbeat_timeout``) stopped beating makes ``recv``/``send`` raise a ``LinkError`` instead of
waiting forever; frames it published before are delivered first. A message's own failure is a
``MessageError`` and leaves the link working: an undecodable frame raises ``DecodeError`` from
that ``recv`` (counted in ``stats.decode_errors``; ``messages`` skips it); a message larger than the ring raises
``MessageTooLargeError`` from ``send`` before anything is written.
"""

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Generic, TypeVar

import msgspec

from .endpoint import Endpoint
from .errors import (
    ChannelClosedError,
    DecodeError,
    IpcError,
    MessageTooLargeError,
    PeerDeadError,
)
from .frames import frame_size, max_payload
from .lifecycle import pid_alive

T = TypeVar("T")

_POLL_BURST_NS = 2_000


@dataclass
class ChannelStats:
    sent: int = 0
    received: int = 0
    decode_errors: int = 0
    parks: int = 0  # waits that outlasted the spin and slept on the semaphore


class Channel(Generic[T]):
    """One end of a link, used from the running event loop (asyncio or uvloop).

    ``Channel(end, decode_type)`` opens end name ``end`` (a string from
    ``IpcPool.create_link``) and must be called with the loop running; every coroutine of
    the channel must run on that loop. ``decode_type`` is what ``recv`` decodes into (any
    type msgspec can decode, typically a union of tagged Structs).

    - ``spin_us``: how long a wait polls before sleeping on the semaphore.
    - ``liveness_interval``: how often a sleeping wait checks the peer, and how often this
      end stamps its heartbeat.
    - ``heartbeat_timeout``: if set, a peer whose heartbeat is older than this is dead even
      if its pid lives (stopped, or its event loop blocked). The peer must itself be a
      ``Channel``: heartbeats come from its event loop.
    """

    def __init__(
        self,
        end: str,
        decode_type: Any = Any,
        *,
        spin_us: float = 100.0,
        liveness_interval: float = 0.25,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._endpoint = Endpoint(end)
        self._tx = self._endpoint.tx
        self._rx = self._endpoint.rx
        self._max_payload = max_payload(self._tx.capacity)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self._decode_type = decode_type
        self._spin_ns = int(spin_us * 1000)
        self._liveness_interval = liveness_interval
        self.watch_heartbeat(heartbeat_timeout)
        self._expected_peer = 0
        self._send_lock = asyncio.Lock()
        self._waiters: set[asyncio.Future] = set()
        self._closed = False
        self.stats = ChannelStats()
        self._beat_timer = self._loop.call_later(liveness_interval, self._beat)
        self._bell_thread = threading.Thread(
            target=self._forward_bells, name=f"lmpool-ipc-bell {end}", daemon=True
        )
        self._bell_thread.start()

    @property
    def max_payload(self) -> int:
        """The most bytes one encoded message may take on this channel (``send`` refuses more)."""
        return self._max_payload

    @property
    def peer_pid(self) -> int:
        """The peer's pid once it has opened its end (or as set by ``expect_peer``)."""
        return self._rx.producer_pid or self._expected_peer

    def expect_peer(self, pid: int) -> None:
        """Watch process ``pid`` as the peer before it has opened its end, so that waits
        fail if it dies first (e.g. a child that crashes on start-up)."""
        self._expected_peer = pid

    # Sending ---------------------------------------------------------------------

    async def send(self, msg: Any) -> None:
        """Encode ``msg`` and append it, waiting while the ring is full. A send that finds
        room does not look at the peer: a dead peer is reported by ``recv``, or by a send
        that has to wait for room."""
        payload = self._encoder.encode(msg)
        if not self._try_send(payload):
            await self._send_when_space(payload)

    async def send_bytes(self, payload) -> None:
        """Append an already encoded message (any bytes-like object) as one frame."""
        if not self._try_send(payload):
            await self._send_when_space(payload)

    def _try_send(self, payload) -> bool:
        """Append ``payload`` if it fits now; raise if it can never be sent."""
        if len(payload) > self._max_payload:
            raise MessageTooLargeError(
                f"a message of {len(payload)} bytes does not fit in a ring of "
                f"{self._tx.capacity} bytes (at most {self._max_payload} bytes per message)"
            )
        self._check_open()
        tx = self._tx
        if tx.consumer_closed:
            raise ChannelClosedError(f"peer process {self.peer_pid} closed the channel")
        # Senders that found the ring full queue on the lock, so that a large message
        # waiting for space is not overtaken forever by smaller ones.
        if self._send_lock.locked() or not tx.try_put(payload):
            return False
        if tx.take_consumer_wakeup():
            self._endpoint.wake_peer()
        self.stats.sent += 1
        return True

    async def _send_when_space(self, payload) -> None:
        tx = self._tx
        need = frame_size(len(payload))
        async with self._send_lock:
            while not tx.try_put(payload):
                await self._wait(
                    lambda: tx.free() >= need,
                    lambda: tx.park_producer(need),
                    tx.unpark_producer,
                    sending=True,
                )
        if tx.take_consumer_wakeup():
            self._endpoint.wake_peer()
        self.stats.sent += 1

    # Receiving -------------------------------------------------------------------

    async def recv(self) -> T:
        """The next message, decoded as the channel's type."""
        payload = self._try_recv()
        if payload is None:
            payload = await self._recv_when_published()
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.stats.decode_errors += 1
            raise DecodeError(
                f"frame of {len(payload)} bytes from process {self.peer_pid} is not a "
                f"valid {_type_name(self._decode_type)}: {e}"
            ) from e

    async def messages(self) -> AsyncIterator[T]:
        """Every message in order, skipping (and counting) those that do not decode: a reader's
        loop, which ends only by the link's ``IpcError``."""
        while True:
            try:
                yield await self.recv()
            except DecodeError:  # that message's failure, not the link's: counted in stats
                continue

    async def recv_bytes(self) -> bytes:
        """The next message's encoded bytes, undecoded."""
        payload = self._try_recv()
        if payload is None:
            payload = await self._recv_when_published()
        return payload

    def _try_recv(self) -> bytes | None:
        self._check_open()
        # One frame at a time, its space handed back at once: a batch of copies held
        # together makes malloc return and re-fault memory for large messages.
        rx = self._rx
        payload = rx.take()
        if payload is not None:
            if rx.take_producer_wakeup():
                self._endpoint.wake_peer()
            self.stats.received += 1
        return payload

    async def _recv_when_published(self) -> bytes:
        rx = self._rx
        while True:
            await self._wait(rx.used, rx.park_consumer, rx.unpark_consumer, sending=False)
            payload = self._try_recv()
            if payload is not None:
                return payload

    # Waiting ---------------------------------------------------------------------

    async def _wait(
        self,
        ready: Callable[[], Any],
        park: Callable[[], bool],
        unpark: Callable[[], None],
        *,
        sending: bool,
    ) -> None:
        """Return once ``ready()`` may be true; raise if the channel or peer goes away."""
        now = time.perf_counter_ns
        deadline = now() + self._spin_ns
        while now() < deadline:
            await asyncio.sleep(0)
            os.sched_yield()
            self._check_open()
            # Poll tightly for a moment before handing the loop and the CPU back: a frame
            # that lands meanwhile is seen at once rather than a loop round later.
            burst_end = now() + _POLL_BURST_NS
            while True:
                if ready():
                    return
                if now() >= burst_end:
                    break
        self.stats.parks += 1
        while True:
            failure = self._peer_failure(sending)
            if failure is not None:
                if not sending and self._rx.used():
                    return  # deliver what the peer published before it went away
                raise failure
            if not park():
                return
            waiter = self._loop.create_future()
            self._waiters.add(waiter)
            timer = self._loop.call_later(self._liveness_interval, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiters.discard(waiter)
                if not self._closed:
                    unpark()
            self._check_open()
            if ready():
                return

    def _peer_failure(self, sending: bool) -> IpcError | None:
        pid = self.peer_pid
        closed = self._tx.consumer_closed if sending else self._rx.producer_closed
        if closed:
            return ChannelClosedError(f"peer process {pid} closed the channel")
        if pid and not pid_alive(pid):
            return PeerDeadError(f"peer process {pid} has exited (or was killed)")
        beat = self._rx.producer_beat_ns
        timeout = self._heartbeat_timeout_ns
        # Silence counts from the later of the last beat and the start of watching.
        if timeout is not None and beat and time.monotonic_ns() - max(beat, self._watched_since_ns) > timeout:
            return PeerDeadError(
                f"peer process {pid} missed its heartbeat: last beat "
                f"{(time.monotonic_ns() - beat) / 1e9:.2f} s ago, timeout {timeout / 1e9:g} s"
            )
        return None

    def watch_heartbeat(self, timeout: float | None) -> None:
        """From now on, a peer silent for more than ``timeout`` seconds is dead (None: stop
        watching). Silence before this call is not held against it, so a peer whose loop was
        blocked while it started (loading a model, say) is watched only once it is up."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"heartbeat timeout must be > 0 seconds or None, got {timeout!r}")
        self._heartbeat_timeout_ns = None if timeout is None else int(timeout * 1e9)
        self._watched_since_ns = time.monotonic_ns()

    def _forward_bells(self) -> None:
        """Helper thread: turn each post of this end's semaphore into a loop wake-up."""
        bell = self._endpoint.bell
        while True:
            bell.acquire()
            if self._closed:
                return
            try:
                self._loop.call_soon_threadsafe(self._on_bell)
            except RuntimeError:  # the loop is closed; nobody is left to wake
                return

    def _on_bell(self) -> None:
        for waiter in self._waiters:
            _wake(waiter)

    def _beat(self) -> None:
        self._endpoint.beat()
        self._beat_timer = self._loop.call_later(self._liveness_interval, self._beat)

    # Lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError(f"channel {self._endpoint.name!r} is closed")

    def close(self) -> None:
        """Close this end: pending waits raise ``ChannelClosedError``, the peer's
        ``recv`` does too once it has read what we sent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._beat_timer.cancel()
        for waiter in self._waiters:
            _wake(waiter)
        self._endpoint.bell.release()  # lets the helper thread see _closed and exit
        self._bell_thread.join()
        self._endpoint.close()

    async def __aenter__(self) -> "Channel[T]":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)
