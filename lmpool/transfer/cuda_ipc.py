"""KV payloads between replicas that share one GPU (NCCL refuses two ranks on one
device): the receiver copies straight out of the sender's GPU memory through CUDA IPC.

Owns this rank's staging buffer (GPU memory the peers map), the regions of it that
sends in flight occupy, a pool of interprocess CUDA events, and this rank's mappings of
its peers' staging buffers and events.

Protocol of one transfer, sender S -> receiver R, tag t:
1. S copies the payload into a free region of its staging buffer on its current stream,
   records one of its free interprocess events there, then publishes
   ``offset,nbytes,event`` under the key of (S, R, t) in the rendezvous store. S's host
   never waits for the GPU.
2. R finds the key, makes its receive stream for S wait on that event (the record
   happened before the key existed, so the wait covers it), copies the region of S's
   mapped buffer into ``out`` on that stream and records a local event.
3. Once that copy has completed R acknowledges under (S, R, t)/ack; then S frees the
   region and the event.

Nothing runs in the background: steps 2 and 3 of every receive advance whenever any
handle of R's transport is polled (``done``) or waited on, so a worker polls its
handles every step, and a rank waiting on its own send still serves its peer.

Invariants:
- a region and its event belong to one transfer from staging until the acknowledgement;
  a send whose wait expired keeps them (R may still be reading) until its
  acknowledgement turns up or the peer is disconnected.
- keys carry both ends' sessions (random per transport), so a restarted worker never
  reads a key its predecessor left behind.
- exports are exchanged through the control plane as ``CudaIpcExport`` messages, one
  per importing peer; nothing is pickled.
- a receiver that finds a size it did not expect acknowledges with the error, so the
  sender fails with the reason instead of timing out.
- a peer whose process is gone fails every wait on it at once (same host: its pid is
  checked), otherwise waits end with TransferTimeout.

Not verified on a GPU from where this was written: see tests/transfer/test_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import bisect
import os
import secrets
import time

import torch

from lmpool.transfer.messages import CudaIpcExport
from lmpool.transfer.transport import TransferTimeout, TransportError, as_bytes, check_args, open_store

ALIGN = 256  # region starts, so that the copy kernels see aligned pointers
_POLL_S = (20e-6, 1e-3)  # wait() polls the store from 20 us, backing off to 1 ms


class Regions:
    """First-fit allocation of byte ranges of a buffer of ``size`` bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        """The start of a free range of ``nbytes``, now taken; None if none is free."""
        nbytes = max(nbytes, 1)
        cursor = 0
        for start in self._starts:
            if start - cursor >= nbytes:
                break
            cursor = -(-self._ends[start] // ALIGN) * ALIGN
        if self.size - cursor < nbytes:
            return None
        bisect.insort(self._starts, cursor)
        self._ends[cursor] = cursor + nbytes
        return cursor

    def free(self, start: int) -> None:
        self._starts.pop(bisect.bisect_left(self._starts, start))
        del self._ends[start]

    def used(self) -> int:
        return sum(end - start for start, end in self._ends.items())


def transfer_key(src: int, src_session: int, dst: int, dst_session: int, tag: int) -> str:
    return f"lmpool/cuda_ipc/{src}.{src_session}>{dst}.{dst_session}/{tag}"


class _Peer:
    def __init__(self, export: CudaIpcExport, mapped: torch.Tensor, events: list[torch.cuda.Event],
                 stream: torch.cuda.Stream) -> None:
        self.rank = export.rank
        self.session = export.session
        self.pid = export.pid
        self.mapped = mapped  # the peer's staging buffer, as uint8
        self.events = events
        # Receives from this peer wait on its events on a stream of their own: if the peer
        # dies between recording an event and the event firing, only this stream can be
        # stuck, never the stream the worker computes on.
        self.stream = stream

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class _Poller:
    """A handle whose progress is made by polling: ``done`` never blocks, ``wait`` polls
    with a growing pause until done or the deadline. Both first advance every receive of
    the transport: a send completes only once its receiver has copied the payload, so a
    process blocked waiting on its own send must still serve its peer's sends to it, or
    two ranks sending to each other and waiting on their sends first would deadlock."""

    what: str
    _transport: "CudaIpcTransport"

    def _poll(self) -> bool:
        raise NotImplementedError

    def _expire(self) -> None:
        pass

    def done(self) -> bool:
        self._transport._progress()
        return self._poll()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = _POLL_S[0]
        while True:
            self._transport._progress()
            if self._poll():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self._expire()
                raise TransferTimeout(f"{self.what} did not complete within {timeout}s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_S[1])
        if self.error is not None:
            raise TransportError(f"{self.what} failed: {self.error}")


class _Send(_Poller):
    def __init__(self, transport: "CudaIpcTransport", peer: _Peer, key: str, offset: int, event: int,
                 payload: torch.Tensor) -> None:
        self.what = f"send of {payload.nbytes} bytes from rank {transport.rank} to rank {peer.rank}"
        self.error: str | None = None
        self._transport, self._peer, self._key = transport, peer, key
        self._offset, self._event = offset, event
        self._payload = payload  # alive until the staging copy is certainly done (acknowledged)
        self._finished = False

    def _poll(self) -> bool:
        if self._finished:
            return True
        store = self._transport._store
        if store.check([self._key + "/ack"]):
            ack = store.get(self._key + "/ack").decode()
            store.delete_key(self._key + "/ack")
            if ack != "ok":
                self.error = ack
            self._release()
        elif not self._peer.alive():
            self.error = f"rank {self._peer.rank} (pid {self._peer.pid}) is gone"
            self._release()  # nobody reads the region any more
        return self._finished

    def _release(self) -> None:
        self._transport._release(self._offset, self._event, self)
        self._finished = True
        self._payload = None

    def _expire(self) -> None:
        # The receiver may still be copying out of the region: keep it, and the event,
        # until the acknowledgement turns up (checked again when space runs out).
        if self not in self._transport._quarantined:
            self._transport._quarantined.append(self)


class _Recv(_Poller):
    def __init__(self, transport: "CudaIpcTransport", peer: _Peer, key: str, out: torch.Tensor) -> None:
        self.what = f"receive of {out.nbytes} bytes by rank {transport.rank} from rank {peer.rank}"
        self.error: str | None = None
        self._transport, self._peer, self._key = transport, peer, key
        self._out = as_bytes(out)
        self._copied: torch.cuda.Event | None = None
        self._finished = False

    def _poll(self) -> bool:
        if self._finished:
            return True
        store = self._transport._store
        if self._copied is None:
            staged = store.check([self._key])
            if not self._peer.alive():  # also before reading: a dead process's memory is not read
                self.error = f"rank {self._peer.rank} (pid {self._peer.pid}) is gone"
                self._finished = True
            if not staged or self._finished:
                return self._finished
            self._start_copy(store.get(self._key).decode())
            if self._finished:  # refused: the sender learns why from the acknowledgement
                return True
        if not self._copied.query():
            return False
        self._acknowledge("ok")
        return True

    def _start_copy(self, staged: str) -> None:
        offset, nbytes, event = (int(x) for x in staged.split(","))
        if nbytes != self._out.numel():
            self._refuse(f"rank {self._peer.rank} sent {nbytes} bytes, {self._out.numel()} were expected")
        elif not (0 <= offset and offset + nbytes <= self._peer.mapped.numel() and 0 <= event < len(self._peer.events)):
            self._refuse(f"rank {self._peer.rank} announced a region or event outside what it exported: {staged}")
        else:
            stream = self._peer.stream
            stream.wait_stream(torch.cuda.current_stream(self._transport.device))  # the caller's work on out
            self._peer.events[event].wait(stream)
            with torch.cuda.stream(stream):
                self._out.copy_(self._peer.mapped[offset:offset + nbytes])
            self._out.record_stream(stream)  # out is not reused while this stream may still write it
            self._copied = torch.cuda.Event()
            self._copied.record(stream)

    def _refuse(self, error: str) -> None:
        self.error = error
        self._acknowledge(f"refused by rank {self._transport.rank}: {error}")

    def _acknowledge(self, ack: str) -> None:
        store = self._transport._store
        store.delete_key(self._key)
        store.set(self._key + "/ack", ack)
        self._finished = True

    def _expire(self) -> None:
        # Never block here: a copy still running waits on the peer's event, which may never
        # fire if the peer died. Unacknowledged, the sender's own wait expires, and its
        # region stays reserved until the acknowledgement or a disconnect.
        pass


class CudaIpcTransport:
    """This rank's end of every CUDA IPC connection of the pool (see the module docstring)."""

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: str, staging_bytes: int,
                 timeout_s: float = 30.0, max_inflight: int = 32) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"cuda_ipc needs a CUDA device with an index (cuda:N), got {device!r}")
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.rank = rank
        self.world_size = world_size
        self.session = secrets.randbits(63)
        self._store = open_store(rendezvous, timeout_s)
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
        self._regions = Regions(staging_bytes)
        with torch.cuda.device(self.device):  # events bind to the current device when first used
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(max_inflight)]
        self._free_events = list(range(max_inflight))
        self._quarantined: list[_Send] = []
        self._receiving: list[_Recv] = []  # receives not yet finished, advanced by _progress
        self._peers: dict[int, _Peer] = {}
        self._closed = False

    def export(self) -> CudaIpcExport:
        """What one peer needs to read from this rank (call once per importing peer)."""
        with torch.cuda.device(self.device):
            (device, handle, nbytes, offset, counter, counter_offset, event,
             event_sync) = self._staging.untyped_storage()._share_cuda_()
            event_handles = [e.ipc_handle() for e in self._events]
        return CudaIpcExport(
            rank=self.rank, session=self.session, pid=os.getpid(), device=device,
            storage_handle=handle, storage_bytes=nbytes, storage_offset=offset,
            ref_counter_handle=counter, ref_counter_offset=counter_offset,
            storage_event_handle=event, storage_event_sync_required=bool(event_sync),
            events=event_handles,
        )

    def connect(self, export: CudaIpcExport) -> None:
        """Map the staging buffer and events ``export`` describes (replacing an earlier
        connection to that rank). Does not wait for the peer."""
        if not 0 <= export.rank < self.world_size or export.rank == self.rank:
            raise ValueError(f"an export from rank {export.rank} cannot be imported by rank {self.rank}")
        if export.device != self.device.index:
            raise ValueError(
                f"rank {export.rank}'s staging buffer is on cuda:{export.device}, this rank is on {self.device}: "
                "cuda_ipc connects replicas on one GPU"
            )
        self.disconnect(export.rank)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                export.device, export.storage_handle, export.storage_bytes, export.storage_offset,
                export.ref_counter_handle, export.ref_counter_offset,
                export.storage_event_handle, export.storage_event_sync_required,
            )
            events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in export.events]
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank} could not map rank {export.rank}'s staging buffer: {e}") from e
        mapped = torch.empty(0, dtype=torch.uint8, device=self.device)
        mapped.set_(storage, 0, (export.storage_bytes,), (1,))
        self._peers[export.rank] = _Peer(export, mapped, events, torch.cuda.Stream(self.device))

    def disconnect(self, peer: int) -> None:
        """Forget ``peer``'s mapping, and free what sends to it still hold (it is gone or
        restarted: nothing of its old incarnation reads this buffer any more)."""
        old = self._peers.pop(peer, None)
        if old is None:
            return
        for send in [s for s in self._quarantined if s._peer is old]:
            send._release()
        for receiving in [r for r in self._receiving if r._peer is old]:
            receiving.error, receiving._finished = f"rank {peer} was disconnected", True

    def send(self, peer: int, payload: torch.Tensor, tag: int) -> _Send:
        check_args(self, peer, payload, tag, self.device)
        target = self._peer(peer)
        nbytes = payload.nbytes
        if nbytes > self._regions.size:
            raise ValueError(f"a payload of {nbytes} bytes exceeds the {self._regions.size}-byte staging buffer")
        offset = self._regions.alloc(nbytes)
        if offset is None or not self._free_events:
            self._reap_quarantined()
            offset = self._regions.alloc(nbytes) if offset is None else offset
        if offset is None or not self._free_events:
            if offset is not None:
                self._regions.free(offset)
            raise TransportError(
                f"rank {self.rank}'s staging buffer has no room for {nbytes} more bytes "
                f"({self._regions.used()} of {self._regions.size} in flight, "
                f"{len(self._events) - len(self._free_events)} of {len(self._events)} events): "
                "wait for earlier sends first"
            )
        event = self._free_events.pop()
        stream = torch.cuda.current_stream(self.device)
        self._staging[offset:offset + nbytes].copy_(as_bytes(payload), non_blocking=True)
        self._events[event].record(stream)
        key = transfer_key(self.rank, self.session, peer, target.session, tag)
        self._store.set(key, f"{offset},{nbytes},{event}")
        return _Send(self, target, key, offset, event, payload)

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> _Recv:
        check_args(self, peer, out, tag, self.device)
        source = self._peer(peer)
        receiving = _Recv(self, source, transfer_key(peer, source.session, self.rank, self.session, tag), out)
        self._receiving.append(receiving)
        return receiving

    def _progress(self) -> None:
        """Advance every unfinished receive: copy what has been staged, acknowledge copies done."""
        if self._receiving:
            self._receiving = [r for r in self._receiving if not r._poll()]

    def _peer(self, peer: int) -> _Peer:
        if self._closed:
            raise TransportError(f"the cuda_ipc transport of rank {self.rank} is closed")
        try:
            return self._peers[peer]
        except KeyError:
            raise TransportError(
                f"rank {self.rank} has not imported rank {peer}'s export: connect(export) first"
            ) from None

    def _release(self, offset: int, event: int, send: _Send) -> None:
        self._regions.free(offset)
        self._free_events.append(event)
        if send in self._quarantined:
            self._quarantined.remove(send)

    def _reap_quarantined(self) -> None:
        for send in list(self._quarantined):
            send._poll()

    def close(self) -> None:
        self._closed = True
        self._peers.clear()
        self._quarantined.clear()
        self._receiving.clear()
