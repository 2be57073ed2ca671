"""KV payloads between CPU replicas: gloo point-to-point over TCP on 127.0.0.1, one
two-rank group per connected peer, connected on threads, one waiter thread per operation in
flight (why: docs/ARCHITECTURE.md, "Data paths").

Invariants:
- both ends of a pair ``connect(peer, session)`` with the same session, never used before
  for the pair; keys in the rendezvous carry it, so stale keys are never read.
- operations started while connecting are posted in order once the pair is up (or fail).
- every payload is preceded by its size; the receive is posted only once sizes agree.
- a pair is connecting, connected or broken; anything that goes wrong breaks it on both
  ends, and every pending and later operation raises ``TransportError`` until both
  reconnect. A broken pair never corrupts another transfer.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from lmpool.dataplane.rendezvous import StoreClient, open_store
from lmpool.dataplane.transport import (
    TAG_LIMIT,
    TransferTimeout,
    TransportError,
    as_bytes,
    check_args,
)
from lmpool.protocol.rendezvous import parse_address

_BREAK_TAG = TAG_LIMIT  # never used by a transfer: see _break_group
CLOSE_WAIT_S = 5.0  # ``close`` waits at most this long for connections under way
_CPU = torch.device("cpu")


class GlooHandle:
    """One operation (or one connection), completed by another thread."""

    def __init__(self, what: str, on_expiry: Callable[[str], None] | None = None) -> None:
        self.what = what
        self._finished = threading.Event()
        self._error: TransportError | None = None
        self._on_expiry = on_expiry

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float) -> None:
        if not self._finished.wait(timeout):
            reason = f"{self.what} did not complete within {timeout}s"
            if self._on_expiry is not None:
                self._on_expiry(reason)
            raise TransferTimeout(reason)
        if self._error is not None:
            raise self._error

    def _finish(self, error: TransportError | None = None) -> None:
        if not self._finished.is_set():
            self._error = error
            self._finished.set()


class _Pair:
    """The connection to one peer under one session."""

    def __init__(self, peer: int, session: int) -> None:
        self.peer = peer
        self.session = session
        # A dist.ProcessGroupGloo once connected; Any, as torch's stubs omit its send and recv.
        self.group: Any = None
        # The group's store, held as long as the pair: torch keeps only the C++ half of a
        # store written in Python alive, and one whose Python half is gone fails every call.
        self.store: StoreClient | None = None
        self.queued: list[tuple[str, torch.Tensor, int, GlooHandle]] = []
        self.pending: set[GlooHandle] = set()
        self.broken: str | None = None

    def close_store(self) -> None:
        """End the store's connection (idempotent); the object stays, for torch's sake."""
        if self.store is not None:
            self.store.close()


class GlooTransport:
    """This rank's end of every gloo connection of the pool (see the module docstring)."""

    def __init__(self, rendezvous: str, rank: int, world_size: int, timeout_s: float = 30.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = _CPU
        parse_address(rendezvous)  # a malformed address fails here, not in a connect thread
        self._rendezvous = rendezvous
        self._lock = threading.Lock()
        self._pairs: dict[int, _Pair] = {}
        self._closed = False
        self._connecting: list[threading.Thread] = []  # connect threads, joined by ``close``

    # ---- connections ------------------------------------------------------------------

    def connect(self, peer: int, session: int) -> GlooHandle:
        """Start (re)connecting to ``peer`` under ``session``; the handle completes once the
        connection is up. A previous connection to ``peer`` is broken first, failing its
        pending operations."""
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer must be another rank in [0, {self.world_size}), not {peer}")
        pair = _Pair(peer, session)
        handle = GlooHandle(f"connecting rank {self.rank} to rank {peer} (session {session})")
        with self._lock:
            self._check_open()
            old = self._pairs.get(peer)
            self._pairs[peer] = pair
        if old is not None:
            self._break(old, f"replaced by session {session}")
        thread = threading.Thread(target=self._connect, args=(pair, handle), name=f"gloo-connect-{peer}", daemon=True)
        thread.start()
        with self._lock:
            self._connecting = [t for t in self._connecting if t.is_alive()] + [thread]
        return handle

    def _connect(self, pair: _Pair, handle: GlooHandle) -> None:
        lo, hi = sorted((self.rank, pair.peer))
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from torch's stubs
        # Loopback only: replicas of one pool share a host, and nothing else should reach them.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        # Bounds the connection and, via the waiter threads, any operation nobody completes.
        options._timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            # A store client of its own: one client serializes its calls, so connections
            # sharing one would wait for each other's peers, and three ranks connecting
            # around a cycle would deadlock.
            pair.store = open_store(self._rendezvous, self.timeout_s)
            store = dist.PrefixStore(f"lmpool/gloo/{lo}-{hi}/{pair.session}", pair.store)
            group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(store, 0 if self.rank == lo else 1, 2, options)
        except (RuntimeError, TransportError) as e:
            error = TransportError(
                f"rank {self.rank} could not connect to rank {pair.peer} (session {pair.session}) "
                f"within {self.timeout_s}s: {_first_line(e)}"
            )
            self._break(pair, str(error))
            pair.close_store()  # broken already (closed while connecting), _break left it
            handle._finish(error)
            return
        with self._lock:
            if pair.broken is None and not self._closed:
                pair.group = group
                for op in pair.queued:
                    self._post(pair, *op)
                pair.queued.clear()
                group = None
        if group is not None:  # replaced or closed while connecting: tell the peer now
            _break_group(group)
            pair.close_store()
            handle._finish(TransportError(f"{handle.what}: {pair.broken or 'transport closed'}"))
        else:
            handle._finish()

    # ---- transfers --------------------------------------------------------------------

    def send(self, peer: int, payload: torch.Tensor, tag: int) -> GlooHandle:
        check_args(self, peer, payload, tag, _CPU)
        what = f"send of {payload.nbytes} bytes from rank {self.rank} to rank {peer} (tag {tag})"
        return self._start("send", peer, as_bytes(payload), tag, what)

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> GlooHandle:
        check_args(self, peer, out, tag, _CPU)
        what = f"receive of {out.nbytes} bytes by rank {self.rank} from rank {peer} (tag {tag})"
        return self._start("recv", peer, as_bytes(out), tag, what)

    def _start(self, op: str, peer: int, data: torch.Tensor, tag: int, what: str) -> GlooHandle:
        with self._lock:
            self._check_open()
            pair = self._pairs.get(peer)
            if pair is None:
                raise TransportError(
                    f"rank {self.rank} has no connection to rank {peer}: call connect({peer}, session) first"
                )
            if pair.broken is not None:
                raise TransportError(
                    f"the connection of rank {self.rank} to rank {peer} (session {pair.session}) is broken "
                    f"({pair.broken}); connect again with a new session"
                )
            handle = GlooHandle(what, on_expiry=lambda reason: self._break(pair, reason))
            pair.pending.add(handle)
            if pair.group is None:
                pair.queued.append((op, data, tag, handle))
            else:
                self._post(pair, op, data, tag, handle)
        return handle

    def _post(self, pair: _Pair, op: str, data: torch.Tensor, tag: int, handle: GlooHandle) -> None:
        """Post one operation on a connected pair (under the lock) and start its waiter.

        Every payload is preceded, on the same tag, by its size: gloo matches one tag's
        messages in order, and a receive posted for the wrong size would not fail but
        abort the whole process (an enforce in gloo's I/O thread calls std::terminate).
        So a receive posts the size first and the payload only once the sizes agree.
        """
        peer_rank = 1 if self.rank < pair.peer else 0
        try:
            if op == "send":
                size = torch.tensor([data.numel()], dtype=torch.int64)
                works = [pair.group.send([size], peer_rank, tag), pair.group.send([data], peer_rank, tag)]
            else:
                size = torch.zeros(1, dtype=torch.int64)
                works = [pair.group.recv([size], peer_rank, tag)]
        except RuntimeError as e:  # gloo already knows the pair is gone
            pair.pending.discard(handle)
            pair.broken = pair.broken or _first_line(e)
            handle._finish(TransportError(f"{handle.what} failed: {pair.broken}"))
            return
        threading.Thread(
            target=self._watch, args=(pair, op, works, size, data, tag, handle),
            name=f"gloo-{op}-{pair.peer}", daemon=True,
        ).start()

    def _watch(self, pair: _Pair, op: str, works: list, size: torch.Tensor, data: torch.Tensor, tag: int,
               handle: GlooHandle) -> None:
        # ``size`` and ``data`` are held here until gloo is done with them, even if the
        # caller gave up on the handle.
        timeout = datetime.timedelta(seconds=self.timeout_s)
        error = None
        try:
            for work in works:
                work.wait(timeout)
            if op == "recv":
                sent = int(size[0])
                if sent != data.numel():
                    error = f"rank {pair.peer} sent {sent} bytes on tag {tag}, {data.numel()} were expected"
                else:
                    with self._lock:
                        if pair.broken is not None:
                            error = pair.broken
                        else:
                            work = pair.group.recv([data], 1 if self.rank < pair.peer else 0, tag)
                    if error is None:
                        work.wait(timeout)
        except RuntimeError as e:
            with self._lock:  # when this end broke the pair, its reason is the real one
                error = pair.broken or _first_line(e)
        if error is not None:
            self._break(pair, error)
            handle._finish(TransportError(f"{handle.what} failed: {error}"))
        else:
            handle._finish()
        with self._lock:
            pair.pending.discard(handle)

    def _break(self, pair: _Pair, reason: str) -> None:
        """Break ``pair`` on both ends, failing everything pending on it (idempotent)."""
        with self._lock:
            if pair.broken is not None:
                return
            pair.broken = reason
            queued, pair.queued = pair.queued, []
            pair.pending.difference_update(handle for _, _, _, handle in queued)
            group = pair.group
        for _, _, _, handle in queued:
            handle._finish(TransportError(f"{handle.what} failed: {reason}"))
        if group is not None:
            _break_group(group)
        pair.close_store()

    def pending(self) -> int:
        """Operations started and not yet finished (for tests and metrics)."""
        with self._lock:
            return sum(len(p.pending) for p in self._pairs.values())

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the gloo transport of rank {self.rank} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            self._break(pair, "transport closed")
        # A process that exits while gloo builds a group on another thread dies in C++
        # ("terminate called without an active exception"): let each connection end first. A
        # peer that closed too makes it fail at once; one that died, within the timeout.
        deadline = time.monotonic() + min(CLOSE_WAIT_S, self.timeout_s)
        for thread in self._connecting:
            thread.join(max(0.0, deadline - time.monotonic()))


def _break_group(group: dist.ProcessGroupGloo) -> None:
    """Close a gloo pair now, on both ends.

    torch 2.13's ``abort()`` and ``shutdown()`` do nothing for gloo. What does close it is
    gloo's own reaction to an expired wait: it fails every operation pending in the
    group's context and closes its connections, so the peer sees "connection closed" at
    once. Expire a wait on purpose, on a tag no transfer uses.
    """
    probe = torch.empty(1, dtype=torch.uint8)
    try:
        # torch's stubs omit a gloo group's recv.
        group.recv([probe], 1 - group.rank(), _BREAK_TAG).wait(datetime.timedelta(milliseconds=1))  # type: ignore[attr-defined]
    except RuntimeError:
        pass  # the expected timeout, or the pair was already closed


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # gloo prefixes its messages with the C++ source location, which says nothing to a reader.
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]  # gloo's advice to check the peer's logs
