"""KV payloads between replicas on different GPUs: NCCL point-to-point over pair
communicators.

Owns two sets of two-rank ``ProcessGroupNCCL`` per connected peer, one set per direction,
each set of ``lanes`` communicators.

Why one communicator per direction: NCCL runs one communicator's operations in issue
order on one stream, so a send to a peer followed by a receive from it would wait for
the peer's matching receive, while the peer, doing the same, waits for ours: opposite
transfers of one pair deadlock on a shared communicator. With one per direction they
run on separate streams.

Why lanes: one communicator runs its operations one after another, and each NCCL operation
pays a start-up (kernel launch, handshake, pipeline fill) before it moves bytes at full
rate; a chunked transfer (``lmpool.transfer.chunked``) pays it once per chunk. With two or
more lanes, consecutive operations of a direction go to different communicators, on
different streams, so the next chunk starts up while the previous one is still on the wire.

Invariants:
- NCCL ignores tags: on one directed pair, both ends must start their transfers in the
  same order (the control plane sends a pair's execute messages in plan order), with
  the same sizes. The tag is only checked for range, and kept in error messages.
- the n-th operation of a direction (counted from ``connect``) runs on lane ``n % lanes``
  on both ends, so order is kept within each lane; both ends must use the same ``lanes``
  (``connect`` checks it through the rendezvous and fails the pair on a mismatch).
- connections are made on a thread (communicator set-up blocks until the peer joins)
  under a session the caller picks and never reuses for the pair, as for gloo.
- both ends set a pair up in one canonical order: the lower rank's outgoing direction
  first. Creating a communicator is collective, so if each end started with its own
  outgoing direction, each would wait in a different communicator for the other.
- set-up ends with a one-element exchange on each direction, in the same canonical
  order: torch may create the point-to-point NCCL communicator lazily at the first
  send/recv, which is collective too, and must not first happen inside transfers that
  the two ends start in different orders.
- a wait that expires aborts the pair's communicators (both directions, every lane): the pair is
  broken until ``connect`` with a new session.
- a completed receive orders the caller's current stream after it (``Work.wait``), so
  unpacking ``out`` on that stream needs no further synchronization.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist

from lmpool.transfer.transport import (
    TransferTimeout,
    TransportError,
    check_args,
    open_store,
    parse_address,
    poll_until,
)


# Communicators per direction of a pair; every lane costs its own NCCL buffers and stream.
# On the H200 pair, 8 chunks over 3 lanes reached 83-90 % of raw NCCL from 224 MiB on
# against 74-88 % over one; 2 lanes were about a point behind 3, and 4 no better than 3
# (results/multi_gpu_NOTES.md).
DEFAULT_LANES = 3
MAX_LANES = 4
# The chunk floor of transfers over several lanes (``chunked.chunk_floor``). With the
# start-up hidden, smaller chunks expose less pack and unpack at the ends: over 3 lanes on
# the H200 pair (results/h200x2/lanes/), chunks of 28 MiB were best or level at every size
# measured (2 chunks at 56 MiB, 4 at 112 MiB, 8 from 224 MiB on). Over lanes the chunks
# share the wire, so their shape is a ramp (``chunked.ramp_chunks``): small at both ends.
# One lane keeps the chunk layer's defaults.
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


class NcclHandle:
    def __init__(self, what: str, work: dist.Work | None, tensor: torch.Tensor | None, pair: "_NcclPair") -> None:
        self.what = what
        self._work, self._tensor, self._pair = work, tensor, pair
        self._error: str | None = None
        self._finished = False

    def done(self) -> bool:
        if not self._finished:
            try:
                if self._work.is_completed():
                    self._work.wait()  # orders the caller's current stream after NCCL's
                    self._finished = True
            except RuntimeError as e:
                self._error = str(e).splitlines()[0]
                self._finished = True
            if self._pair.broken is not None and not self._finished:
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
        self.outgoing: list[dist.ProcessGroup] = []  # per lane; this rank is rank 0 (the sender)
        self.incoming: list[dist.ProcessGroup] = []  # per lane; this rank is rank 1 (the receiver)
        self.sent = self.received = 0  # operations started per direction: the next one's lane
        self.ready = threading.Event()
        self.broken: str | None = None

    def next_outgoing(self) -> dist.ProcessGroup:
        group = self.outgoing[self.sent % len(self.outgoing)]
        self.sent += 1
        return group

    def next_incoming(self) -> dist.ProcessGroup:
        group = self.incoming[self.received % len(self.incoming)]
        self.received += 1
        return group

    def abort(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            for group in (*self.outgoing, *self.incoming):
                try:
                    group.abort()  # fails pending operations instead of leaving them hung
                except (AttributeError, RuntimeError):
                    pass  # an older torch without abort, or a communicator already torn down


class NcclTransport:
    """This rank's end of every NCCL connection of the pool (see the module docstring)."""

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: str, timeout_s: float = 30.0,
                 lanes: int = DEFAULT_LANES) -> None:
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransportError("this torch build has no NCCL")
        self.lanes = lanes
        # What the chunk layer cuts over this transport (None: its defaults, CHUNK_BYTES and "even").
        self.chunk_bytes = LANED_CHUNK_BYTES if lanes > 1 else None
        self.chunk_shape = "ramp" if lanes > 1 else None
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"nccl needs a CUDA device with an index (cuda:N), got {device!r}")
        parse_address(rendezvous)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        # Point-to-point needs no NVLink multicast; its buffers would cost memory per communicator.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
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
            store = dist.PrefixStore(f"lmpool/nccl/lanes/{pair.session}",
                                     open_store(self._rendezvous, self.timeout_s))
            check_lanes(store, self.rank, pair.peer, self.lanes)
            low, high = sorted((self.rank, pair.peer))
            directions = ((low, high), (high, low))  # the same order on both ends
            for src, dst in directions:
                for lane in range(self.lanes):
                    store = dist.PrefixStore(f"lmpool/nccl/{src}>{dst}/{pair.session}/{lane}",
                                             open_store(self._rendezvous, self.timeout_s))
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = datetime.timedelta(seconds=self.timeout_s)
                    group = dist.ProcessGroupNCCL(store, 0 if src == self.rank else 1, 2, options)
                    group.eager_connect_single_device(self.device)  # set up now, not in the first transfer
                    (pair.outgoing if src == self.rank else pair.incoming).append(group)
            probe = torch.zeros(1, dtype=torch.int32, device=self.device)
            for src, _ in directions:
                for lane in range(self.lanes):
                    if src == self.rank:
                        work = pair.outgoing[lane].send([probe], 1, 0)
                    else:
                        work = pair.incoming[lane].recv([probe], 0, 0)
                    work.wait()
            torch.cuda.synchronize(self.device)
        except (RuntimeError, TransportError) as e:
            pair.abort(f"could not connect to rank {pair.peer} (session {pair.session}): {e}")
        pair.ready.set()

    def _pair(self, peer: int, wait_s: float) -> _NcclPair:
        pair = self._pairs.get(peer)
        if pair is None:
            raise TransportError(f"rank {self.rank} has no connection to rank {peer}: call connect({peer}, session) first")
        # Communicators are made on their thread; an operation cannot be queued before
        # them, so the first transfer waits for the connection (bounded).
        if not pair.ready.wait(wait_s):
            raise TransportError(f"the connection of rank {self.rank} to rank {peer} is not up after {wait_s}s")
        if pair.broken is not None:
            raise TransportError(f"the connection to rank {peer} (session {pair.session}) is broken ({pair.broken}); "
                                 "connect again with a new session")
        return pair

    def send(self, peer: int, payload: torch.Tensor, tag: int) -> NcclHandle:
        check_args(self, peer, payload, tag, self.device)
        pair = self._pair(peer, self.timeout_s)
        work = pair.next_outgoing().send([payload], 1, 0)
        return NcclHandle(f"send of {payload.nbytes} bytes from rank {self.rank} to rank {peer} (tag {tag})",
                          work, payload, pair)

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> NcclHandle:
        check_args(self, peer, out, tag, self.device)
        pair = self._pair(peer, self.timeout_s)
        work = pair.next_incoming().recv([out], 0, 0)
        return NcclHandle(f"receive of {out.nbytes} bytes by rank {self.rank} from rank {peer} (tag {tag})",
                          work, out, pair)

    def close(self) -> None:
        for pair in self._pairs.values():
            pair.abort("transport closed")
        self._pairs.clear()
