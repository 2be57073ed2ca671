"""The pool's KV events, read in the serving process: the control process's vLLM-format
publisher (ZMQ PUB, and its replay socket for the full state) applied to a ``HostKVView``.

The feed connects before the pool starts, so it hears the pool's first batches; whenever it
cannot vouch for having every batch (the first one it hears, a sequence number that skips one:
a slow joiner, or batches dropped at the high-water mark; or the first one after its connection
to the publisher dropped: the control process was restarted, and its publisher with it, whose
numbers begin again and may by chance continue the old ones) it asks the replay socket for
the full state and applies it, per rank, before the PUB batches after it. Subscribers wait on
``wait_past(seq)``, woken at each host batch; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmpool.frontend.grpc.host_events import HostKVView
from lmpool.protocol.vllm_kv_events import END_SEQ, SNAPSHOT_REQUEST, event_types

log = logging.getLogger("uvicorn.error")


class PoolEventFeed:
    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", array_like: bool = True) -> None:
        self.view = HostKVView()
        self._decode: Callable[[bytes], Any] = msgspec.msgpack.Decoder(event_types(array_like).batch).decode
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.set_hwm(100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # Told when the connection to the publisher drops: ZMQ queues that event before the
        # reconnection can carry a batch, so it is read before any batch of a new publisher.
        self._drops = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)  # before the publisher binds: ZMQ connects once it is there
        self._replay_endpoint = replay_endpoint
        self._tick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.ended = False
        self.resyncs = 0  # full-state reads, for the tests

    def start(self) -> PoolEventFeed:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(_report)
        return self

    async def wait_past(self, seq: int) -> bool:
        """True once the host has published a batch numbered above ``seq``; False once the
        streams are ended (the server is stopping)."""
        while self.view.seq <= seq and not self.ended:
            await self._tick.wait()
        return not self.ended

    def end_streams(self) -> None:
        self.ended = True
        self._published()

    def _published(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def _run(self) -> None:
        expected: int | None = None  # the PUB seq that follows what the view holds
        last: int | None = None  # the last PUB seq heard
        while True:
            _, seq_bytes, payload = (await self._sub.recv_multipart())[-3:]
            seq = int.from_bytes(seq_bytes, "big")
            if await self._dropped() or (last is not None and seq <= last):
                expected = None  # the publisher may be another (a restarted control process's), or missed some
            last = seq
            if expected is None or seq > expected:
                expected = await self._resync() + 1
            if seq != expected:
                if seq > expected:  # still a gap: read the state again at the next batch
                    expected = None
                continue  # already in the state read
            self._apply(self._decode(payload))
            expected = seq + 1

    async def _dropped(self) -> bool:
        """Whether the connection to the publisher dropped since this was last asked."""
        dropped = False
        while await self._drops.poll(0):
            dropped |= parse_monitor_message(await self._drops.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def _apply(self, batch) -> None:
        if batch.data_parallel_rank is not None and self.view.apply(batch.data_parallel_rank, batch.events):
            self._published()

    async def _resync(self) -> int:
        """Apply the publisher's full state; the seq it is current as of."""
        self.resyncs += 1
        batches, last = await self._read_state()
        ranks = {batch.data_parallel_rank for batch in batches}
        for rank in set(self.view.ranks()) - ranks:
            if self.view.rank_gone(rank):
                self._published()
        for batch in batches:
            self._apply(batch)
        log.debug("KV-event feed: read the pool's state (%d batches, as of seq %d)", len(batches), last)
        return last

    async def _read_state(self) -> tuple[list, int]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        try:
            await sock.send_multipart((b"", SNAPSHOT_REQUEST))
            batches: list[Any] = []
            last = -1
            while True:
                _, seq, payload = await sock.recv_multipart()
                if seq == END_SEQ:
                    return batches, last
                last = int.from_bytes(seq, "big", signed=True)
                batches.append(self._decode(payload))
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        self.end_streams()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sub.disable_monitor()
        self._drops.close(linger=0)
        self._sub.close(linger=0)
        self._ctx.term()


def _report(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("KV-event feed stopped: smg no longer hears this host's KV events", exc_info=task.exception())
