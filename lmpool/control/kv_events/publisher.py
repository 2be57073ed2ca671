"""A ZMQ publisher of KV events in vLLM's format, with replay and a full-state snapshot.

``stored`` / ``removed`` / ``cleared`` queue events of one rank; ``flush`` publishes each
rank's queued events as one batch: ``[topic, seq, msgpack(batch)]`` on the PUB socket, seq
counting up from 0 across ranks. The last ``buffer_steps`` batches (consecutive seqs) stay for
replay. Batches carry every stored block's token ids, whichever tenant's, salted or not (a
salt changes hashes, not tokens): the endpoints belong on loopback or a trusted network.

On the replay socket (ROUTER; vLLM's protocol) a client sends ``[b"", start_seq]`` (8 bytes,
big-endian) and gets ``[b"", seq, payload]`` for the buffered batches from ``start_seq`` on,
the newest ``replay_max_batches`` at most, then the end marker ``[b"", -1, b""]``; a first seq
above ``start_seq`` shows what is gone (vLLM's answer once its buffer has rolled past). Sending
``SNAPSHOT_REQUEST`` instead gets the full current state: per rank ever published (one cleared
and empty since included), ``AllBlocksCleared`` and the ``BlockStored`` of every block it holds
(in the order stored), at most
``replay_max_batches`` batches in all, each tagged with the seq of the last batch published
before it, then the end marker. Applying the snapshot and then the PUB batches with a larger
seq reproduces the state.

All on the caller's asyncio loop, never blocking it: no send waits (a PUB socket drops what a
slow subscriber cannot take; the seq shows the gap), and requests are served one at a time,
the loop getting a turn after each and after every ``SENDS_PER_TURN`` replies. A client with one
request outstanding gets its whole answer; one that is gone or lets its queue fill loses the
request. An inbound frame over ``MAX_INBOUND_BYTES`` disconnects its sender, unbuffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from itertools import islice
from typing import cast

import msgspec
import zmq
import zmq.asyncio

from lmpool.config.kv_events import REPLAY_MAX_BATCHES
from lmpool.protocol.vllm_kv_events import END_SEQ, MEDIUM_GPU, SNAPSHOT_REQUEST, event_types

SNAPSHOT_BLOCKS_PER_BATCH = 256  # the fewest blocks a snapshot batch holds, but a rank's last
SENDS_PER_TURN = 8  # replies sent before the loop gets a turn
# A request is 8 or 16 bytes and a subscription the topic; ZMTP's handshake commands reach a
# few hundred bytes (a 255-byte routing id), and ZMQ applies the limit to them too.
MAX_INBOUND_BYTES = 1024


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, array_like: bool = True, hwm: int = 100_000,
                 replay_max_batches: int = REPLAY_MAX_BATCHES) -> None:
        self.types = event_types(array_like)
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = topic.encode()
        self.replay_max_batches = max(1, replay_max_batches)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES + len(self._topic))  # a PUB reads subscriptions
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, when 0 was asked for
        self._replay = self._replay_socket(replay_endpoint) if replay_endpoint else None
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pending: dict[int, list] = {}
        # rank -> {block hash: BlockStored of that one block}, in the order stored.
        self._state: dict[int, dict[bytes | int, object]] = {}
        self._events = 0  # events queued so far: with the next seq, the version of the state
        self._snapshot: tuple[tuple[int, int], list] | None = None  # (version, its batches)
        self._task: asyncio.Task | None = None
        self.requests_received = 0  # messages read from the replay socket
        self.requests_dropped = 0  # requests whose client was gone or had a full queue
        self.replies_sent = 0  # messages sent on the replay socket, end markers included

    def _replay_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        # A send to a full or gone client fails (Again, EHOSTUNREACH) instead of vanishing, so
        # its request stops there.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Room for two answers: ZMQ frees a queue's space in steps of half its HWM, so a client
        # that has read its last answer has room for the next whole one.
        sock.setsockopt(zmq.SNDHWM, 2 * (self.replay_max_batches + 2))
        sock.bind(endpoint)
        return sock

    def start(self) -> KVEventPublisher:
        """Serve replay and snapshot requests on the running loop."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    # ---- events ---------------------------------------------------------------------------

    def stored(self, rank: int, block_hashes: list[bytes | int], parent_hash: bytes | int | None, token_ids: list[int],
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

    def announced(self, rank: int, block_hash: bytes | int) -> bool:
        """Whether ``block_hash`` was stored on ``rank`` and not removed or cleared since."""
        return block_hash in self._state.get(rank, ())

    def removed(self, rank: int, block_hashes: list[bytes | int]) -> None:
        self._queue(rank, self.types.removed(list(block_hashes), MEDIUM_GPU))
        state = self._state.get(rank, {})
        for h in block_hashes:
            state.pop(h, None)

    def cleared(self, rank: int) -> None:
        """Every block of ``rank`` is gone (it restarted, or died)."""
        self._queue(rank, self.types.cleared())
        # Kept, empty: a snapshot then clears the rank too, for a consumer that missed this event
        # and still holds the rank's old blocks.
        self._state[rank] = {}

    def _queue(self, rank: int, event) -> None:
        self._events += 1
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
        """The full current state: per rank, AllBlocksCleared then every block it holds, in
        batches of ``SNAPSHOT_BLOCKS_PER_BATCH`` blocks or more, as many as it takes to be at most
        ``replay_max_batches`` batches in all (but one per rank at least). Kept for the next
        request until the state changes (copying a large state takes milliseconds): shared, not
        to be changed."""
        version = (self._events, self._next_seq)
        if self._snapshot is None or self._snapshot[0] != version:
            self._snapshot = (version, self._split_state())
        return self._snapshot[1]

    def _split_state(self) -> list:
        ranks = [(rank, list(blocks.values())) for rank, blocks in sorted(self._state.items())]
        spare = max(1, self.replay_max_batches - len(ranks))  # batches beyond each rank's first
        size = max(SNAPSHOT_BLOCKS_PER_BATCH, -(-sum(len(blocks) for _, blocks in ranks) // spare))
        now, batch, out = time.time(), self.types.batch, []
        for rank, blocks in ranks:
            out.append(batch(now, [self.types.cleared(), *blocks[:size]], rank))
            out.extend(batch(now, blocks[i:i + size], rank) for i in range(size, len(blocks), size))
        return out

    def _replies(self, request: bytes):
        """The ``(seq, payload)`` replies to one request, taken from the state as it is now (the
        sends that follow give the loop turns, and the state may move on meanwhile)."""
        if request == SNAPSHOT_REQUEST:
            return self._snapshot_replies()
        if len(request) != 8:
            return iter(())
        return self._replay_replies(int.from_bytes(request, "big"))

    def _replay_replies(self, start: int):
        """The buffered batches from ``start`` on, the newest ``replay_max_batches`` of them."""
        if not self._buffer:
            return iter(())
        first, last = self._buffer[0][0], self._buffer[-1][0]  # seqs are consecutive
        count = min(self.replay_max_batches, last + 1 - max(start, first))
        newest = list(islice(reversed(self._buffer), max(count, 0)))[::-1]
        return ((seq.to_bytes(8, "big"), payload) for seq, payload in newest)

    def _snapshot_replies(self):
        last = (self._next_seq - 1).to_bytes(8, "big", signed=True)
        return ((last, self._encode(batch)) for batch in self.snapshot_batches())  # each encoded as it is sent

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # served only with a replay socket (start)
        while True:
            frames = await replay.recv_multipart()
            self.requests_received += 1
            if len(frames) == 3:  # [client, b"", request]; anything else is not of this protocol
                await self._answer(frames[0], frames[2])
            # A queued request's recv completes without a turn of the loop: give it one.
            await asyncio.sleep(0)

    async def _answer(self, client: bytes, request: bytes) -> None:
        sent = 0
        for seq, payload in self._replies(request):
            if not self._send(client, seq, payload):
                self.requests_dropped += 1
                return
            sent += 1
            if sent % SENDS_PER_TURN == 0:
                await asyncio.sleep(0)
        if not self._send(client, END_SEQ, b""):
            self.requests_dropped += 1

    def _send(self, client: bytes, seq: bytes, payload: bytes) -> bool:
        """One reply, without waiting: False when the client is gone or its queue is full."""
        replay = self._replay
        assert replay is not None  # replies go out only on a replay socket
        for _ in range(2):
            # Done at once: this task alone sends here, never blocking, so no send is ever queued.
            sent = cast(asyncio.Future, replay.send_multipart((client, b"", seq, payload), flags=zmq.NOBLOCK))
            error = sent.exception()
            if error is None:
                self.replies_sent += 1
                return True
            if not isinstance(error, zmq.Again):
                return False  # EHOSTUNREACH: gone
            # ZMQ hears that a client has read its queue through commands that a send processes
            # at most once a millisecond or so; reading EVENTS processes them now.
            replay.get(zmq.EVENTS)
        return False

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
