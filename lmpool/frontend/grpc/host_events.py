"""The host's KV cache as one worker: the union of its ranks' blocks, as numbered event batches.

smg indexes a gRPC worker's KV events by the worker's URL and ignores a batch's ``dp_rank``
(its ``KvEventMonitor`` applies every event of a stream to one worker), while the pool routes
each request among its replicas itself. So the host publishes its replicas' caches as one: a
block is stored for the host when its first replica caches it, removed when its last copy goes,
and a replica that restarts or dies (``AllBlocksCleared`` of its rank) removes only the blocks
no other replica holds. A rank's events are applied as the pool's publisher sends them (vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, one rank per batch).

Invariants: a host batch is published only when the host's set of blocks changed; its sequence
numbers are consecutive, from a base taken from the clock at start, so a restarted host never
reuses a number its predecessor sent (a subscriber resuming from an old number is told it is
gone, and re-reads the state); ``snapshot`` followed by the batches after ``seq`` reproduces the
host's set; the last ``buffer_batches`` batches stay for subscribers that resume.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from lmpool.protocol.vllm_kv_events import MEDIUM_GPU, event_types

TYPES = event_types(True)


@dataclass
class HostBatch:
    """What smg's converter (``smg_grpc_servicer.kv_events.convert_batch``) reads: no rank, the host's."""

    seq: int
    events: list
    ts: float = field(default_factory=time.time)


@dataclass
class _Block:
    parent: int | bytes | None
    tokens: list[int]
    block_size: int


class HostKVView:
    def __init__(self, buffer_batches: int = 10_000, base_seq: int | None = None) -> None:
        # Microseconds since the epoch: above any number a predecessor on this host reached.
        self.seq = time.time_ns() // 1000 if base_seq is None else base_seq
        self._oldest = self.seq + 1  # the first number still available to a resuming subscriber
        self._buffer: deque[HostBatch] = deque(maxlen=buffer_batches)
        self._ranks: dict[int, set] = {}  # rank -> the hashes it holds
        self._copies: dict = {}  # hash -> how many ranks hold it
        self._blocks: dict = {}  # hash -> _Block, in the order the host stored them

    def apply(self, rank: int, events: list) -> HostBatch | None:
        """Apply one rank's batch of vLLM events; the host batch it makes, if the host changed."""
        out: list = []
        for event in events:
            # By name, as smg's converter reads them: the map and array layouts are distinct classes.
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(rank, event, out)
            elif kind == "BlockRemoved":
                self._removed(rank, event.block_hashes, out)
            elif kind == "AllBlocksCleared":
                self._removed(rank, list(self._ranks.get(rank, ())), out)
        return self._publish(out) if out else None

    def ranks(self) -> list[int]:
        return list(self._ranks)

    def rank_gone(self, rank: int) -> HostBatch | None:
        """A rank whose events stopped (the publisher's state was re-read): its blocks go."""
        return self.apply(rank, [TYPES.cleared()])

    def _stored(self, rank: int, event, out: list) -> None:
        held = self._ranks.setdefault(rank, set())
        parent, size = event.parent_block_hash, event.block_size
        run: list = []  # blocks new to the host, chained onto each other
        for i, h in enumerate(event.block_hashes):
            tokens = list(event.token_ids[i * size:(i + 1) * size])
            if h not in held:
                held.add(h)
                self._copies[h] = self._copies.get(h, 0) + 1
                if self._copies[h] == 1:
                    self._blocks[h] = _Block(parent, tokens, size)
                    run.append(h)
                    parent = h
                    continue
            if run:  # a block the host already had ends the run
                out.append(self._chain(run))
                run = []
            parent = h
        if run:
            out.append(self._chain(run))

    def _chain(self, hashes: list) -> object:
        first = self._blocks[hashes[0]]
        tokens = [t for h in hashes for t in self._blocks[h].tokens]
        return TYPES.stored(list(hashes), first.parent, tokens, first.block_size, None, MEDIUM_GPU, None)

    def _removed(self, rank: int, hashes: list, out: list) -> None:
        held = self._ranks.get(rank, set())
        gone = []
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            self._copies[h] -= 1
            if not self._copies[h]:
                del self._copies[h], self._blocks[h]
                gone.append(h)
        if gone:
            out.append(TYPES.removed(gone, MEDIUM_GPU))

    def _publish(self, events: list) -> HostBatch:
        self.seq += 1
        batch = HostBatch(self.seq, events)
        if len(self._buffer) == self._buffer.maxlen:
            self._oldest = self._buffer[0].seq + 1
        self._buffer.append(batch)
        return batch

    def snapshot(self) -> HostBatch:
        """The whole state as one batch numbered ``seq`` (it is current as of that batch):
        ``AllBlocksCleared``, then the blocks in the order stored, chained runs merged."""
        events: list = [TYPES.cleared()]
        run: list = []
        for h, block in self._blocks.items():
            if run and block.parent != run[-1]:
                events.append(self._chain(run))
                run = []
            run.append(h)
        if run:
            events.append(self._chain(run))
        return HostBatch(self.seq, events)

    def since(self, start: int) -> list[HostBatch] | None:
        """The batches numbered ``start`` and on, or None when some of them are gone (or were
        never sent by this host: a number from before its start)."""
        if not self._oldest <= start <= self.seq + 1:
            return None
        return [batch for batch in self._buffer if batch.seq >= start]
