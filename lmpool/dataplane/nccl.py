"""KV payloads between replicas on different GPUs: NCCL point-to-point over pair
communicators, one set per direction of ``lanes`` communicators, each on its own stream
(why: docs/ARCHITECTURE.md, "Data paths").

Invariants:
- NCCL ignores tags: both ends of a directed pair start their transfers in the same order
  and sizes (the control plane sends a pair's execute orders in plan order).
- the n-th operation of a direction runs on lane ``n % lanes`` on both ends; both ends use
  the same ``lanes`` (``connect`` checks it and fails the pair on a mismatch).
- each lane's stream is its own (``streams.acquire``); an operation starts after everything
  queued on the caller's stream, and its tensor is kept until the lane is past it.
- connections are made on a thread, in one canonical order, under a session never reused
  for the pair, and end with a one-element exchange on every lane.
- an expired wait or a communicator error aborts the whole pair (every lane, both
  directions) until ``connect`` with a new session.
- a completed receive orders the caller's stream after it.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from lmpool.dataplane import nccl_lib, streams
from lmpool.dataplane.rendezvous import open_store
from lmpool.dataplane.transport import (
    TransferTimeout,
    TransportError,
    check_args,
    poll_until,
)
from lmpool.protocol.rendezvous import parse_address

# Communicators per direction of a pair; every lane costs its own NCCL buffers and stream.
# On the H200 pair, 8 chunks over 3 lanes reached 83-90 % of raw NCCL from 224 MiB on
# against 74-88 % over one; 2 lanes were about a point behind 3, and 4 no better than 3
# (results/multi_gpu_NOTES.md).
DEFAULT_LANES = 3
MAX_LANES = 4
# The chunk floor of transfers over several lanes (``chunked.chunk_floor``). With the
# start-up hidden, smaller chunks expose less pack and unpack at the ends: over 3 lanes on
# the H200 pair (results/h200x2/lanes/), chunks of 28 MiB were best or level at every size
# measured (2 chunks at 56 MiB, 4 at 112 MiB, 8 from 224 MiB on). One lane keeps the
# chunk layer's default.
LANED_CHUNK_BYTES = 28 << 20


def check_lanes(store: dist.Store, rank: int, peer: int, lanes: int) -> None:
    """Publish this end's ``lanes`` and raise ``TransportError``, saying why, if the peer's
    differ: each end would otherwise wait in a communicator the other never creates.
    Blocks (up to the store's timeout) until the peer has published its own."""
    store.set(f"{rank}>{peer}", str(lanes))
    theirs = int(store.get(f"{peer}>{rank}"))
    if theirs != lanes:
        raise TransportError(f"rank {rank} uses {lanes} NCCL lanes per direction but rank {peer} uses {theirs}: "
                             "both ends of a pair need the same number")


class _Lane:
    """One communicator of a direction and the stream its operations run on: a stream of its
    own (``streams``), never one of torch's pool, which would hand it to someone else too."""

    def __init__(self, comm: nccl_lib.Communicator, device: torch.device) -> None:
        self.comm = comm
        self.stream = streams.acquire(device)

    def start(self, op: str, tensor: torch.Tensor, peer: int) -> torch.cuda.Event:
        """Enqueue ``op`` ("send"/"recv") of ``tensor`` with the communicator's ``peer`` after the
        caller's queued work; the returned event fires when it has completed."""
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        getattr(self.comm, op)(tensor.data_ptr(), tensor.nbytes, peer, self.stream.cuda_stream)
        tensor.record_stream(self.stream)  # not reused before the lane is past it
        done = torch.cuda.Event()
        done.record(self.stream)
        return done


# How often a pending operation asks its communicator for a background error. The question
# is not free (ncclCommGetAsyncError), and a caller spinning on ``done`` would otherwise ask
# it on every poll; an error is rare and seen this late at worst.
ERROR_CHECK_S = 0.01


class NcclHandle:
    def __init__(self, what: str, done: torch.cuda.Event, tensor: torch.Tensor, lane: _Lane,
                 pair: "_NcclPair") -> None:
        self.what = what
        self._done, self._lane, self._pair = done, lane, pair
        self._tensor: torch.Tensor | None = tensor  # held until the operation is over
        self._error: str | None = None
        self._finished = False
        self._checked = time.monotonic()  # when the communicator was last asked for an error

    def done(self) -> bool:
        if not self._finished:
            # A broken pair first: an abort ends NCCL's kernels early, so the event of an
            # operation it cut short fires too, over bytes that never fully arrived.
            if self._pair.broken is not None:
                self._error, self._finished = self._pair.broken, True
            elif self._done.query():
                assert self._tensor is not None  # let go only once finished
                torch.cuda.current_stream(self._tensor.device).wait_event(self._done)  # order the caller after
                self._finished = True
            elif time.monotonic() - self._checked >= ERROR_CHECK_S:
                self._checked = time.monotonic()
                error = self._lane.comm.async_error()
                if error is not None:
                    self._pair.abort(f"{self.what} failed: {error}")
                    self._error, self._finished = self._pair.broken, True
            if self._finished:
                self._tensor = None
        return self._finished

    def wait(self, timeout: float) -> None:
        if not poll_until(self.done, timeout):
            self._pair.abort(f"{self.what} did not complete within {timeout}s")
            raise TransferTimeout(f"{self.what} did not complete within {timeout}s")
        if self._error is not None:
            raise TransportError(f"{self.what} failed: {self._error}")


class _NcclPair:
    def __init__(self, peer: int, session: int) -> None:
        self.peer, self.session = peer, session
        self.outgoing: list[_Lane] = []  # per lane; this rank is rank 0 (the sender)
        self.incoming: list[_Lane] = []  # per lane; this rank is rank 1 (the receiver)
        self.sent = self.received = 0  # operations started per direction: the next one's lane
        self.ready = threading.Event()
        self.broken: str | None = None
        self._lock = threading.Lock()  # lanes are added on the connect thread, aborted on any

    def add(self, lane: _Lane, outgoing: bool) -> None:
        """Take a lane the connect thread made. One made after the pair was aborted (replaced
        by a new session, or a wait expired meanwhile) is ended at once: the abort has already
        passed the lanes it saw."""
        with self._lock:
            (self.outgoing if outgoing else self.incoming).append(lane)
            if self.broken is None:
                return
        _end(lane)

    def next_outgoing(self) -> _Lane:
        lane = self.outgoing[self.sent % len(self.outgoing)]
        self.sent += 1
        return lane

    def next_incoming(self) -> _Lane:
        lane = self.incoming[self.received % len(self.incoming)]
        self.received += 1
        return lane

    def abort(self, reason: str) -> None:
        """Break the pair: every lane's communicator is aborted and its stream given back, once."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            lanes = (*self.outgoing, *self.incoming)
        for lane in lanes:
            _end(lane)


def _end(lane: _Lane) -> None:
    try:
        lane.comm.abort()  # fails pending operations instead of leaving them hung
    except nccl_lib.NcclError:
        pass  # already failing: the pair is broken either way
    streams.release(lane.stream)


class NcclTransport:
    """This rank's end of every NCCL connection of the pool (see the module docstring)."""

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: str, timeout_s: float = 30.0,
                 lanes: int = DEFAULT_LANES) -> None:
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
        if not torch.cuda.is_available():
            raise TransportError("nccl needs CUDA, which this torch build or machine lacks")
        # Point-to-point needs no NVLink multicast; its buffers would cost memory per communicator.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        try:
            nccl_lib.library()
        except nccl_lib.NcclError as e:
            raise TransportError(str(e)) from None
        self.lanes = lanes
        self.chunk_bytes = LANED_CHUNK_BYTES if lanes > 1 else None  # None: chunked.CHUNK_BYTES
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"nccl needs a CUDA device with an index (cuda:N), got {device!r}")
        parse_address(rendezvous)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._rendezvous = rendezvous
        self._pairs: dict[int, _NcclPair] = {}

    def connect(self, peer: int, session: int) -> threading.Event:
        """Start connecting to ``peer`` under ``session``; the event is set once both
        directions are up (or the attempt failed: see ``send``/``recv`` errors)."""
        old = self._pairs.get(peer)
        if old is not None:
            old.abort(f"replaced by session {session}")
        pair = self._pairs[peer] = _NcclPair(peer, session)
        threading.Thread(target=self._connect, args=(pair,), daemon=True, name=f"nccl-connect-{peer}").start()
        return pair.ready

    def _connect(self, pair: _NcclPair) -> None:
        try:
            torch.cuda.set_device(self.device)
            store = open_store(self._rendezvous, self.timeout_s)
            check_lanes(dist.PrefixStore(f"lmpool/nccl/lanes/{pair.session}", store), self.rank, pair.peer,
                        self.lanes)
            low, high = sorted((self.rank, pair.peer))
            directions = ((low, high), (high, low))  # the same order on both ends
            for src, dst in directions:
                for lane in range(self.lanes):
                    key = f"lmpool/nccl/{src}>{dst}/{pair.session}/{lane}"
                    if src == self.rank:  # the sender makes the id, the receiver waits for it
                        uid = nccl_lib.unique_id()
                        store.set(key, uid)
                    else:
                        uid = store.get(key)
                    comm = nccl_lib.Communicator(uid, 2, 0 if src == self.rank else 1)
                    pair.add(_Lane(comm, self.device), outgoing=src == self.rank)
                    if pair.broken is not None:  # replaced or failed meanwhile: make no more
                        raise TransportError(pair.broken)
            probes = torch.zeros(2, dtype=torch.int32, device=self.device)  # one to send, one to receive into
            for src, _ in directions:
                for lane in range(self.lanes):
                    if src == self.rank:
                        pair.outgoing[lane].start("send", probes[0:1], 1)
                    else:
                        pair.incoming[lane].start("recv", probes[1:2], 0)
            torch.cuda.synchronize(self.device)
        except (RuntimeError, TransportError) as e:  # NcclError, a store timeout, a CUDA error
            pair.abort(f"could not connect to rank {pair.peer} (session {pair.session}): {e}")
        pair.ready.set()

    def _pair(self, peer: int, wait_s: float) -> _NcclPair:
        pair = self._pairs.get(peer)
        if pair is None:
            raise TransportError(f"rank {self.rank} has no connection to rank {peer}: "
                                 f"call connect({peer}, session) first")
        # Communicators are made on their thread; an operation cannot be queued before
        # them, so the first transfer waits for the connection (bounded).
        if not pair.ready.wait(wait_s):
            raise TransportError(f"the connection of rank {self.rank} to rank {peer} is not up after {wait_s}s")
        if pair.broken is not None:
            raise TransportError(f"the connection to rank {peer} (session {pair.session}) is broken ({pair.broken}); "
                                 "connect again with a new session")
        return pair

    def send(self, peer: int, payload: torch.Tensor, tag: int) -> NcclHandle:
        return self._start("send", peer, payload, tag)

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> NcclHandle:
        return self._start("recv", peer, out, tag)

    def _start(self, op: str, peer: int, tensor: torch.Tensor, tag: int) -> NcclHandle:
        check_args(self, peer, tensor, tag, self.device)
        pair = self._pair(peer, self.timeout_s)
        # In a direction's communicators this rank is rank 0 when it sends, rank 1 when it receives.
        lane, other = (pair.next_outgoing(), 1) if op == "send" else (pair.next_incoming(), 0)
        what = (f"send of {tensor.nbytes} bytes from rank {self.rank} to rank {peer} (tag {tag})" if op == "send"
                else f"receive of {tensor.nbytes} bytes by rank {self.rank} from rank {peer} (tag {tag})")
        try:
            done = lane.start(op, tensor, other)
        except nccl_lib.NcclError as e:
            pair.abort(str(e))
            raise TransportError(f"{what} failed: {e}") from None
        return NcclHandle(what, done, tensor, lane, pair)

    def close(self) -> None:
        for pair in self._pairs.values():
            pair.abort("transport closed")
        self._pairs.clear()
