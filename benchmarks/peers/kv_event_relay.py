"""The pool's KV events in vLLM's data-parallel layout: one PUB socket and one replay socket per rank.

LMPool's control plane publishes every replica's events on one socket, each batch tagged with
its replica as ``data_parallel_rank`` (``lmpool.control.kv_events``). vLLM under data
parallelism runs one publisher per rank instead (the base port plus the rank), each with its own
sequence numbers and replay buffer, and consumers are written for that. Dynamo's KV router is
one (ai-dynamo/dynamo ``lib/kv-router/src/services/indexer/listener.rs``, as 1.6 runs it): a
listener per data-parallel rank, each applying every batch its socket delivers under the batch's
own rank (its code notes that it "assumes one dp_rank per ZMQ socket"), and replaying a gap in
that socket's sequence from the worker's replay endpoint, which it accepts only for a worker of
one rank. Pointing every rank's listener at the pool's one socket would apply each batch once per
rank and leave gaps it cannot replay.

``RankRelay`` subscribes to the pool's stream and forwards each batch, its payload byte for byte
(LMPool's msgpack, hashes as the pool publishes them), to its rank's socket under that rank's
own sequence number from 0, keeping the last ``buffer_steps`` of each rank for replay (vLLM's
protocol: ``[b"", start seq]`` in, ``[b"", seq, payload]`` per batch out, then ``[b"", -1,
b""]``). A rank's socket is an XPUB, which hears its subscribers: forwarding starts once every
rank's socket has one (``subscribed``), with what the pool's replay socket holds by then, so a
consumer sees each rank's stream from seq 0 without a replay; the pool's batches wait in the
relay's subscription meanwhile (``start`` returns once that connection is up). Later, a gap in
the pool's sequence is read from the pool's replay socket, and a consumer's gap from this
relay's.

A pool that restarts (its control process, or the whole pool or server on the same endpoints)
publishes from seq 0 again, and a batch's seq can no longer say whether it was forwarded. So each
new connection to the pool's stream after the first resynchronises from the pool's snapshot: per
rank ``AllBlocksCleared`` and the blocks it holds, forwarded as each rank's next batches, then
the pool's batches after the snapshot's seq. Each rank's sequence only grows: a consumer (whose
listener takes a seq at or below one it applied for a stale duplicate) applies the restart's
events, its stale blocks cleared. Requests to the pool's replay socket go on a DEALER of their
own, connected for that request, so none waits on a connection to a pool that is gone.

Runs on the caller's asyncio loop and never blocks it (a PUB socket drops what a slow
subscriber cannot take; the sequence shows the gap). Every socket is bound to 127.0.0.1 on a
free port; ``aclose`` ends the tasks, then the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from lmpool.protocol.vllm_kv_events import END_SEQ, SNAPSHOT_REQUEST

log = logging.getLogger("lmpool.benchmarks.kv_event_relay")


class _Head(msgspec.Struct, array_like=True):
    """A batch read only as far as its rank (vLLM's ``KVEventBatch``: ts, events, rank)."""

    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_head = msgspec.msgpack.Decoder(_Head).decode


class RankRelay:
    def __init__(self, endpoint: str, replay_endpoint: str, world_size: int, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, answer_timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self._topic = topic.encode()
        self._answer_timeout_s = answer_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sockets: list[zmq.asyncio.Socket] = []
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.set_hwm(hwm)
        self._handshakes = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connecting
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._pubs, self._replays = [], []
        for _ in range(world_size):
            pub = self._socket(zmq.XPUB)  # a PUB that hears its subscribers' subscriptions
            pub.set_hwm(hwm)
            pub.bind("tcp://127.0.0.1:0")
            replay = self._socket(zmq.ROUTER)
            replay.bind("tcp://127.0.0.1:0")
            self._pubs.append(pub)
            self._replays.append(replay)
        self.endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self._pubs]
        self.replay_endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self._replays]
        self._next = [0] * world_size  # each rank's next sequence number
        self._buffers: list[deque[tuple[int, bytes]]] = [deque(maxlen=buffer_steps) for _ in range(world_size)]
        self._last = -1  # the pool's last sequence number forwarded
        self.forwarded = [0] * world_size  # batches forwarded per rank
        self.replays_served = [0] * world_size  # replay requests answered per rank
        self.lost = 0  # pool batches gone from the pool's buffer before this relay read them
        self.unranked = 0  # batches without a rank of this pool (dropped)
        self.resyncs = 0  # snapshots forwarded after a new connection to the pool's stream
        self._turn = asyncio.Lock()  # one of forwarding a batch and resynchronising at a time
        self._subscribed = [asyncio.Event() for _ in range(world_size)]
        self._tasks: list[asyncio.Task] = []

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    async def start(self) -> RankRelay:
        """Connect to the pool's stream, then hear subscriptions, serve replays, and forward once
        every rank's socket has a subscriber."""
        try:
            await asyncio.wait_for(self._handshakes.recv_multipart(), self._answer_timeout_s)
        except TimeoutError:
            raise RuntimeError(f"no connection to the pool's KV-event stream within {self._answer_timeout_s:g} s") \
                from None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow()), loop.create_task(self._reconnections()),
                       *(loop.create_task(self._serve_replay(r)) for r in range(self.world_size)),
                       *(loop.create_task(self._hear(r)) for r in range(self.world_size))]
        return self

    async def subscribed(self) -> None:
        """Return once every rank's socket has had a subscription."""
        for event in self._subscribed:
            await event.wait()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._sub.disable_monitor()
        self._handshakes.close(linger=0)
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

    async def _hear(self, rank: int) -> None:
        while True:
            message = await self._pubs[rank].recv()
            if message[:1] == b"\x01":  # a subscription (b"\x00" ends one)
                self._subscribed[rank].set()

    # ---- the pool's stream -----------------------------------------------------------------

    async def _follow(self) -> None:
        await self.subscribed()
        async with self._turn:
            await self._catch_up()  # what the pool published before (its later batches wait in the SUB socket)
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue  # not a batch of this protocol
            async with self._turn:
                await self._take(int.from_bytes(frames[1], "big"), frames[2])

    async def _take(self, seq: int, payload: bytes) -> None:
        if seq > self._last + 1:  # missed (published before the subscription landed, or dropped)
            await self._catch_up()
        if seq > self._last:
            self._forward(seq, payload)

    async def _reconnections(self) -> None:
        """Resynchronise from the pool's snapshot at each new connection to its stream."""
        await self.subscribed()
        while True:
            await self._handshakes.recv_multipart()
            async with self._turn:
                try:
                    await self._resync()
                except RuntimeError as e:  # a pool gone again before it answered: the next connection resyncs
                    log.warning("KV-event relay: no resynchronisation after a reconnection: %s", e)

    async def _resync(self) -> None:
        """Forward the pool's current state (per rank: cleared, then its blocks), and take its
        batches after the snapshot's seq from here on."""
        snapshot = await self._ask(SNAPSHOT_REQUEST)
        self.resyncs += 1
        for seq, payload in snapshot:
            self._forward(seq, payload)
        if snapshot:
            self._last = snapshot[-1][0]
        else:  # the pool has published nothing yet: its first batch is seq 0
            self._last = -1

    async def _catch_up(self) -> None:
        """Forward the pool's buffered batches after the last one forwarded."""
        for seq, payload in await self._ask((self._last + 1).to_bytes(8, "big")):
            if seq > self._last:
                self.lost += max(0, seq - self._last - 1)  # older than the pool's buffer
                self._forward(seq, payload)

    async def _ask(self, request: bytes) -> list[tuple[int, bytes]]:
        """The pool's replay socket's answer to ``request``: ``(seq, payload)`` up to its end marker."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        answer = []
        try:
            await dealer.send_multipart((b"", request))
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), self._answer_timeout_s)
                except TimeoutError:
                    raise RuntimeError(f"the pool's KV-event replay socket did not answer within "
                                       f"{self._answer_timeout_s:g} s") from None
                if len(frames) != 3:
                    continue
                _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return answer
                answer.append((int.from_bytes(seq_bytes, "big", signed=True), payload))
        finally:
            dealer.close(linger=0)

    def _forward(self, pool_seq: int, payload: bytes) -> None:
        self._last = pool_seq
        try:
            rank = _head(payload).data_parallel_rank
        except msgspec.DecodeError:
            rank = None
        if rank is None or not 0 <= rank < self.world_size:
            self.unranked += 1
            return
        seq, self._next[rank] = self._next[rank], self._next[rank] + 1
        self._buffers[rank].append((seq, payload))
        self.forwarded[rank] += 1
        with contextlib.suppress(zmq.Again):  # past the high-water mark: dropped, the seq shows the gap
            self._pubs[rank].send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    # ---- replay, per rank ------------------------------------------------------------------

    async def _serve_replay(self, rank: int) -> None:
        sock = self._replays[rank]
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue  # not a request of this protocol
            client, _, request = frames
            if len(request) == 8:
                start = int.from_bytes(request, "big")
                for seq, payload in list(self._buffers[rank]):  # a copy: forwarding goes on meanwhile
                    if seq >= start:
                        await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self.replays_served[rank] += 1
            await sock.send_multipart((client, b"", END_SEQ, b""))
