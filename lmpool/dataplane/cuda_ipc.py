"""KV transfers between replicas whose GPUs can address each other's memory (one GPU, or
NVLink peers): this rank's exports (KV cache, staging buffer, interprocess events), its
mappings of peers' exports, and the operations in flight. ``pull`` copies blocks straight
out of a peer's mapped cache (docs/ARCHITECTURE.md, "Data paths"); ``send``/``recv`` move
packed payloads through the staging buffers.

Invariants:
- a pull's handle is done only once its copy completed while the source process was alive;
  the caller keeps the source's blocks pinned and complete in memory until then, and a
  mapping stays alive until no copy of this rank still reads it.
- a packed send's staging region and event belong to one transfer until the receiver
  acknowledges it (kept past an expired wait); a size the receiver did not expect fails the
  sender with the reason. Receives advance whenever any handle of this transport is polled.
- exports travel as ``CudaIpcExport`` messages, one per importing peer, never pickled; keys
  in the rendezvous carry both ends' sessions, so a restarted worker never reads a stale one.
- a peer whose process is gone (pid and start time checked) fails every wait on it at once.
"""

from __future__ import annotations

import bisect
import math
import os
import secrets

import torch

from lmpool.dataplane import streams
from lmpool.dataplane.block_copy import copy_blocks, load_extension
from lmpool.dataplane.rendezvous import open_store
from lmpool.dataplane.transport import TransferTimeout, TransportError, as_bytes, check_args, poll_until
from lmpool.protocol.cuda_ipc import CudaIpcExport, IpcStorage

ALIGN = 256  # region starts, so that the copy kernels see aligned pointers
_POLL_S = (20e-6, 1e-3)  # wait() polls from 20 us, backing off to 1 ms
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


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


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if no live process
    has that pid. A zombie counts as gone: it has exited, and its GPU memory with it."""
    # Raw os calls: every pull asks twice, and this is several times cheaper than a Path read.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = stat.rsplit(b")", 1)[1].split()  # the command name may hold spaces and ")"
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def share_storage(storage: torch.UntypedStorage) -> IpcStorage:
    handle, nbytes, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()[1:]
    return IpcStorage(handle=handle, nbytes=nbytes, offset=offset, ref_counter_handle=counter,
                      ref_counter_offset=counter_offset, event_handle=event, event_sync_required=bool(event_sync))


def map_storage(device: int, s: IpcStorage) -> torch.Tensor:
    """An exported storage mapped into this process, as a flat uint8 tensor."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device, s.handle, s.nbytes, s.offset, s.ref_counter_handle, s.ref_counter_offset,
        s.event_handle, s.event_sync_required,
    )
    mapped = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    mapped.set_(storage, 0, (s.nbytes,), (1,))
    return mapped


class _Peer:
    def __init__(self, export: CudaIpcExport, staging: torch.Tensor | None, events: list[torch.cuda.Event],
                 cache: torch.Tensor | None, stream: torch.cuda.Stream) -> None:
        self.rank = export.rank
        self.session = export.session
        self.pid = export.pid
        self.pid_start = export.pid_start
        self.staging = staging  # the peer's staging buffer, as uint8 (None: it exports none)
        self.events = events
        self.cache = cache  # the peer's KV cache, typed and shaped (None: it shares none)
        # Receives from this peer wait on its events on a stream of their own (``streams``:
        # torch's pool would share it with others): if the peer dies between recording an
        # event and the event firing, only this stream can be stuck, never the stream the
        # worker computes on, nor another peer's.
        self.stream = stream
        self.pulls = 0  # pulls in flight that read ``cache``

    def alive(self) -> bool:
        start = process_start(self.pid)
        return start is not None and (self.pid_start == 0 or start == self.pid_start)

    def idle(self) -> bool:
        """Nothing of this rank still reads the mappings (safe to release them)."""
        return self.pulls == 0 and self.stream.query()


class _Poller:
    """A handle whose progress is made by polling: ``done`` never blocks, ``wait`` polls
    with a growing pause until done or the deadline. Both first advance every receive of
    the transport: a send completes only once its receiver has copied the payload, so a
    process blocked waiting on its own send must still serve its peer's sends to it, or
    two ranks sending to each other and waiting on their sends first would deadlock."""

    what: str
    error: str | None
    _transport: "CudaIpcTransport"

    def _poll(self) -> bool:
        raise NotImplementedError

    def _expire(self) -> None:
        pass

    def done(self) -> bool:
        self._transport._progress()
        return self._poll()

    def wait(self, timeout: float) -> None:
        if not poll_until(self.done, timeout, *_POLL_S):
            self._expire()
            raise TransferTimeout(f"{self.what} did not complete within {timeout}s")
        if self.error is not None:
            raise TransportError(f"{self.what} failed: {self.error}")


class _Pull(_Poller):
    def __init__(self, transport: "CudaIpcTransport", peer: _Peer, num_blocks: int, copied: torch.cuda.Event) -> None:
        self.what = f"pull of {num_blocks} blocks by rank {transport.rank} from rank {peer.rank}"
        self.error: str | None = None
        self._transport, self._peer = transport, peer  # the peer holds the mapping the copy reads
        self._copied = copied
        self._finished = False
        peer.pulls += 1

    def _poll(self) -> bool:
        if not self._finished and self._copied.query():
            self._finished = True
            self._peer.pulls -= 1
            if not self._peer.alive():
                self.error = (f"rank {self._peer.rank} (pid {self._peer.pid}) died while its blocks were "
                              "copied: the bytes are not trusted")
        return self._finished


class _Send(_Poller):
    def __init__(self, transport: "CudaIpcTransport", peer: _Peer, key: str, offset: int, event: int,
                 payload: torch.Tensor) -> None:
        self.what = f"send of {payload.nbytes} bytes from rank {transport.rank} to rank {peer.rank}"
        self.error: str | None = None
        self._transport, self._peer, self._key = transport, peer, key
        self._offset, self._event = offset, event
        self._payload: torch.Tensor | None = payload  # alive until the staging copy is certainly done (acknowledged)
        self._finished = False

    def _poll(self) -> bool:
        if self._finished:
            return True
        store = self._transport._store()
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
        store = self._transport._store()
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
        assert self._copied is not None  # _start_copy made it, or refused (finished above)
        if not self._copied.query():
            return False
        self._acknowledge("ok")
        return True

    def _start_copy(self, staged: str) -> None:
        offset, nbytes, event = (int(x) for x in staged.split(","))
        staging = self._peer.staging
        assert staging is not None  # a peer that sends has exported its staging buffer
        if nbytes != self._out.numel():
            self._refuse(f"rank {self._peer.rank} sent {nbytes} bytes, {self._out.numel()} were expected")
        elif not (0 <= offset and offset + nbytes <= staging.numel() and 0 <= event < len(self._peer.events)):
            self._refuse(f"rank {self._peer.rank} announced a region or event outside what it exported: {staged}")
        else:
            stream = self._peer.stream
            stream.wait_stream(torch.cuda.current_stream(self._transport.device))  # the caller's work on out
            self._peer.events[event].wait(stream)
            with torch.cuda.stream(stream):
                self._out.copy_(staging[offset:offset + nbytes])
            self._out.record_stream(stream)  # out is not reused while this stream may still write it
            self._copied = torch.cuda.Event()
            self._copied.record(stream)

    def _refuse(self, error: str) -> None:
        self.error = error
        self._acknowledge(f"refused by rank {self._transport.rank}: {error}")

    def _acknowledge(self, ack: str) -> None:
        store = self._transport._store()
        store.delete_key(self._key)
        store.set(self._key + "/ack", ack)
        self._finished = True

    def _expire(self) -> None:
        # Never block here: a copy still running waits on the peer's event, which may never
        # fire if the peer died. Unacknowledged, the sender's own wait expires, and its
        # region stays reserved until the acknowledgement or a disconnect.
        pass


class CudaIpcTransport:
    """This rank's end of every CUDA IPC connection of the pool (see the module docstring).

    ``kv_cache``: this rank's cache, exported so that peers can pull from it (None: pulls
    from this rank are refused). ``staging_bytes``: the largest packed payload this rank
    sends at once (0: packed sends are refused). ``use_kernels``: pull with the transfer
    kernel (False: the torch reference, which materialises the payload).
    """

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: str, staging_bytes: int = 0,
                 timeout_s: float = 30.0, max_inflight: int = 32, kv_cache: torch.Tensor | None = None,
                 use_kernels: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"cuda_ipc needs a CUDA device with an index (cuda:N), got {device!r}")
        if staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got {staging_bytes}")
        if kv_cache is not None:
            if kv_cache.device != self.device or not kv_cache.is_contiguous() or kv_cache.storage_offset() != 0:
                raise ValueError(f"kv_cache must be a contiguous tensor at the start of its storage on {self.device}")
            if kv_cache.dtype not in DTYPE_NAMES:
                raise ValueError(f"kv_cache must be one of {sorted(DTYPE_NAMES.values())}, got {kv_cache.dtype}")
        self.rank = rank
        self.world_size = world_size
        self.session = secrets.randbits(63)
        self.kv_cache = kv_cache
        self.use_kernels = use_kernels
        if kv_cache is not None and use_kernels:
            load_extension()  # built now: a first pull must not stall its caller for a compile
        self._rendezvous, self._timeout_s = rendezvous, timeout_s
        self._store_client = None  # opened on the first packed transfer: pulls need no store
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) if staging_bytes else None
        self._regions = Regions(staging_bytes)
        with torch.cuda.device(self.device):  # events bind to the current device when first used
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(max_inflight if staging_bytes else 0)]
        self._free_events = list(range(len(self._events)))
        self._quarantined: list[_Send] = []
        self._receiving: list[_Recv] = []  # receives not yet finished, advanced by _progress
        self._peers: dict[int, _Peer] = {}
        self._pulling: list[_Pull] = []  # pulls whose copy has not been seen complete
        self._retired: list[_Peer] = []  # replaced or disconnected, released once idle
        self._pid_start = process_start(os.getpid()) or 0
        self._closed = False

    # ---- connections ------------------------------------------------------------------

    def export(self, peer: int = -1, pair_session: int = 0) -> CudaIpcExport:
        """What ``peer`` needs to read from this rank (call once per importing peer)."""
        with torch.cuda.device(self.device):
            staging = share_storage(self._staging.untyped_storage()) if self._staging is not None else None
            cache = share_storage(self.kv_cache.untyped_storage()) if self.kv_cache is not None else None
            events = [e.ipc_handle() for e in self._events]
        return CudaIpcExport(
            rank=self.rank, peer=peer, session=self.session, pid=os.getpid(), pid_start=self._pid_start,
            device=self.device.index, pair_session=pair_session, staging=staging, events=events, kv_cache=cache,
            kv_shape=list(self.kv_cache.shape) if self.kv_cache is not None else [],
            kv_dtype=DTYPE_NAMES[self.kv_cache.dtype] if self.kv_cache is not None else "",
        )

    def connect(self, export: CudaIpcExport) -> None:
        """Map what ``export`` describes (replacing an earlier connection to that rank).
        Does not wait for the peer."""
        if not 0 <= export.rank < self.world_size or export.rank == self.rank:
            raise ValueError(f"an export from rank {export.rank} cannot be imported by rank {self.rank}")
        if not can_reach(self.device.index, export.device):
            raise ValueError(
                f"rank {export.rank}'s memory is on cuda:{export.device}, which {self.device} cannot access "
                "directly: cuda_ipc connects replicas on one GPU or on peer-accessible GPUs"
            )
        dtype = None
        if export.kv_cache is not None:
            dtype = next((t for t, name in DTYPE_NAMES.items() if name == export.kv_dtype), None)
            if dtype is None or len(export.kv_shape) != 6 or export.kv_shape[1] != 2:
                raise ValueError(f"rank {export.rank} exported a cache of {export.kv_dtype!r} {export.kv_shape}")
            if math.prod(export.kv_shape) * dtype.itemsize > export.kv_cache.nbytes:
                raise ValueError(f"rank {export.rank}'s cache {export.kv_shape} does not fit its "
                                 f"{export.kv_cache.nbytes}-byte storage")
        self.disconnect(export.rank)
        # The peer's memory is mapped into this rank's own device, even when it lives on a
        # peer GPU: a mapping opened in the owning device's context is not addressable by
        # kernels on this device (enabling peer access afterwards does not cover IPC
        # mappings), while one opened here lets the driver enable peer access for it.
        # torch then sees the peer's cache as a tensor on this device, which is where the
        # pull kernel runs.
        here = self.device.index
        try:
            staging = map_storage(here, export.staging) if export.staging is not None else None
            events = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", export.device), h) for h in export.events]
            cache = None
            if dtype is not None:
                assert export.kv_cache is not None  # dtype is set only with a cache
                nbytes = math.prod(export.kv_shape) * dtype.itemsize
                cache = map_storage(here, export.kv_cache)[:nbytes].view(dtype).view(export.kv_shape)
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank} could not map rank {export.rank}'s memory: {e}") from e
        # Never given back: a stream left waiting on a dead peer's event must not serve anyone else.
        self._peers[export.rank] = _Peer(export, staging, events, cache, streams.acquire(self.device))

    def connected(self, peer: int) -> bool:
        return peer in self._peers

    def disconnect(self, peer: int) -> None:
        """Forget ``peer``'s mapping, and free what sends to it still hold (it is gone or
        restarted: nothing of its old incarnation reads this buffer any more). The mapping
        itself is released once no copy of this rank reads it."""
        old = self._peers.pop(peer, None)
        if old is None:
            return
        for send in [s for s in self._quarantined if s._peer is old]:
            send._release()
        for receiving in [r for r in self._receiving if r._peer is old]:
            receiving.error, receiving._finished = f"rank {peer} was disconnected", True
        self._retired.append(old)

    # ---- the pull path ----------------------------------------------------------------

    def pull(self, peer: int, src_ids: list[int], dst_ids: list[int]) -> _Pull:
        """Start copying blocks ``src_ids`` of ``peer``'s cache into blocks ``dst_ids`` of
        this rank's cache (see the module docstring for what the caller guarantees)."""
        source = self._peer(peer)
        if source.cache is None:
            raise TransportError(f"rank {peer} shares no KV cache with rank {self.rank}: pulls need one")
        if self.kv_cache is None:
            raise TransportError(f"rank {self.rank} has no KV cache to pull into")
        if not source.alive():  # a dead process's memory is never read
            raise TransportError(f"rank {peer} (pid {source.pid}) is gone")
        with torch.cuda.device(self.device):
            # copy_blocks validates the ids (ValueError) before it launches anything.
            copy_blocks(source.cache, src_ids, self.kv_cache, dst_ids, use_kernel=self.use_kernels)
            copied = torch.cuda.Event()
            copied.record()
        handle = _Pull(self, source, len(dst_ids), copied)
        self._pulling.append(handle)
        return handle

    # ---- the packed path (KVTransport) ------------------------------------------------

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
        assert self._staging is not None  # a region was found in it
        self._staging[offset:offset + nbytes].copy_(as_bytes(payload), non_blocking=True)
        self._events[event].record(stream)
        key = transfer_key(self.rank, self.session, peer, target.session, tag)
        self._store().set(key, f"{offset},{nbytes},{event}")
        return _Send(self, target, key, offset, event, payload)

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> _Recv:
        check_args(self, peer, out, tag, self.device)
        source = self._peer(peer)
        if source.staging is None:
            raise TransportError(f"rank {peer} exported no staging buffer: it cannot send packed payloads")
        receiving = _Recv(self, source, transfer_key(peer, source.session, self.rank, self.session, tag), out)
        self._receiving.append(receiving)
        return receiving

    # ---- bookkeeping ------------------------------------------------------------------

    def _progress(self) -> None:
        """Advance every unfinished receive (copy what has been staged, acknowledge copies
        done) and release retired mappings nothing reads any more."""
        if self._receiving:
            self._receiving = [r for r in self._receiving if not r._poll()]
        if self._pulling:
            self._pulling = [p for p in self._pulling if not p._poll()]
        if self._retired:
            self._retired = [p for p in self._retired if not p.idle()]

    def _store(self):
        if self._store_client is None:
            self._store_client = open_store(self._rendezvous, self._timeout_s)
        return self._store_client

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
        """Refuse new operations and drop every mapping that nothing reads. Pulls in flight
        are waited for: they depend on nothing outside this process, so this ends. A
        receive's copy may wait on a dead peer's event forever: its peer's mapping stays
        referenced (``_retired``) rather than being unmapped under it."""
        self._closed = True
        for pull in self._pulling:
            pull._copied.synchronize()
        for peer in list(self._peers):
            self.disconnect(peer)
        self._progress()
        self._quarantined.clear()
        self._receiving.clear()


def can_reach(device: int, peer_device: int) -> bool:
    """Whether a kernel on ``device`` can read memory on ``peer_device`` (same GPU, or peer access)."""
    return device == peer_device or torch.cuda.can_device_access_peer(device, peer_device)
