"""A ZMQ publisher of KV events in vLLM's format, with replay and a full-state snapshot.

``stored`` / ``removed`` / ``cleared`` queue events of one rank; ``flush`` publishes each
rank's queued events as one batch: ``[topic, seq, msgpack(batch)]`` on the PUB socket, seq
counting up from 0 across ranks. The last ``buffer_steps`` batches stay for replay.

On the replay socket (ROUTER; vLLM's protocol) a client sends ``[b"", start_seq]`` (8 bytes,
big-endian) and gets ``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on,
then the end marker ``[b"", -1, b""]``. Sending ``SNAPSHOT_REQUEST`` instead gets the full
current state: per rank, one batch of ``AllBlocksCleared`` and the ``BlockStored`` of every
block the rank holds (in the order they were stored), each tagged with the seq of the last
batch published before it, then the end marker. Applying the snapshot and then the PUB
batches with a larger seq reproduces the state (what a consumer needs after a restart).

Everything runs on the caller's asyncio loop; a send never blocks it (a PUB socket drops
what a slow subscriber cannot take, and the seq shows the gap).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from lmpool.protocol.vllm_kv_events import MEDIUM_GPU, event_types

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot-request"


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, array_like: bool = True, hwm: int = 100_000) -> None:
        self.types = event_types(array_like)
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, when 0 was asked for
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pending: dict[int, list] = {}
        # rank -> {block hash: BlockStored of that one block}, in the order stored.
        self._state: dict[int, dict[int, object]] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> KVEventPublisher:
        """Serve replay and snapshot requests on the running loop."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    # ---- events ---------------------------------------------------------------------------

    def stored(self, rank: int, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
               block_size: int) -> None:
        """A chain of blocks became cached on ``rank``: ``block_hashes[0]`` follows ``parent_hash``
        (None at the root), each next block the one before; ``token_ids`` are all their tokens."""
        if len(token_ids) != block_size * len(block_hashes):
            raise ValueError(f"{len(block_hashes)} blocks of {block_size} tokens, got {len(token_ids)} tokens")
        stored = self.types.stored
        self._queue(rank, stored(list(block_hashes), parent_hash, list(token_ids), block_size, None, MEDIUM_GPU, None))
        state = self._state.setdefault(rank, {})
        parent = parent_hash
        for i, h in enumerate(block_hashes):
            tokens = list(token_ids[i * block_size:(i + 1) * block_size])
            state[h] = stored([h], parent, tokens, block_size, None, MEDIUM_GPU, None)
            parent = h

    def removed(self, rank: int, block_hashes: list[int]) -> None:
        self._queue(rank, self.types.removed(list(block_hashes), MEDIUM_GPU))
        state = self._state.get(rank, {})
        for h in block_hashes:
            state.pop(h, None)

    def cleared(self, rank: int) -> None:
        """Every block of ``rank`` is gone (it restarted, or died)."""
        self._queue(rank, self.types.cleared())
        self._state.pop(rank, None)

    def _queue(self, rank: int, event) -> None:
        self._pending.setdefault(rank, []).append(event)

    def flush(self) -> None:
        """Publish each rank's queued events as one batch."""
        pending, self._pending = self._pending, {}
        for rank, events in pending.items():
            self._publish(self.types.batch(time.time(), events, rank))

    def _publish(self, batch) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = self._encode(batch)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # past the high-water mark: dropped, seq shows the gap
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    # ---- replay and snapshot ---------------------------------------------------------------

    def snapshot_batches(self) -> list:
        """The full current state: per rank, AllBlocksCleared then every block it holds."""
        now = time.time()
        return [self.types.batch(now, [self.types.cleared(), *blocks.values()], rank)
                for rank, blocks in sorted(self._state.items())]

    def _replies(self, request: bytes) -> list[tuple[bytes, bytes]]:
        if request == SNAPSHOT_REQUEST:
            last = (self._next_seq - 1).to_bytes(8, "big", signed=True)
            return [(last, self._encode(batch)) for batch in self.snapshot_batches()]
        if len(request) != 8:
            return []
        start = int.from_bytes(request, "big")
        return [(seq.to_bytes(8, "big"), payload) for seq, payload in self._buffer if seq >= start]

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # not a request of this protocol
            client, _, request = frames
            for seq, payload in self._replies(request):
                await self._replay.send_multipart((client, b"", seq, payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
