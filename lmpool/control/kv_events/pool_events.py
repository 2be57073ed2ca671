"""The pool's page-table reports, turned into vLLM-format KV events (``KVEventPublisher``).

The control process calls ``snapshot`` for each snapshot a worker sends (its start, or a
resync after a gap), ``delta`` for each delta the page table applied, and ``rank_down`` when
a worker is gone. A snapshot replaces what was known of the rank (``AllBlocksCleared``, then
its blocks); consecutive stored blocks that chain onto each other become one ``BlockStored``,
as vLLM sends them. A block is announced once (a newer copy of an announced block is not news),
and its removal is published once the page table, having applied the delta, holds no ready
copy of it there (a removal of another copy, stale or a transfer's reserved block, is not
news either): the page table is the truth the events describe, and the publisher's replay
state (``publisher.announced``, which keeps each block's tokens for snapshots: the page table
keeps hashes only) is the one record of what consumers were told.

Block hashes go out as vLLM sends them by default, the low 64 bits of the digest as an integer
(``external_block_hash``), which is the form consumers such as Dynamo's KV router decode;
``int_hashes=False`` sends the whole 32-byte hashes instead (vLLM with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

Configured by the pool's configuration tree (``PoolConfig.kv_events``, a ``KVEventsConfig``);
without it ``from_config`` gives ``NO_KV_EVENTS``, whose hooks do nothing, and pyzmq is never
imported.
"""

from __future__ import annotations

from lmpool.config.kv_events import KVEventsConfig
from lmpool.control.page_table.view import PageTableView
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import BlockStored, KVDelta, KVSnapshot
from lmpool.protocol.vllm_kv_events import external_block_hash


class NoKVEvents:
    def snapshot(self, rank: int, snapshot: KVSnapshot) -> None:
        pass

    def delta(self, rank: int, delta: KVDelta) -> None:
        pass

    def rank_down(self, rank: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_KV_EVENTS = NoKVEvents()


def from_config(config: KVEventsConfig | None, table: PageTableView):
    """The events of ``table`` that ``config`` asks for (published from the running loop), or ``NO_KV_EVENTS``."""
    if config is None:
        return NO_KV_EVENTS
    from lmpool.control.kv_events.publisher import KVEventPublisher

    publisher = KVEventPublisher(config.endpoint, config.replay_endpoint, config.topic, config.buffer_steps,
                                 config.array_like, replay_max_batches=config.replay_max_batches)
    return PoolKVEvents(publisher.start(), table, config.int_hashes)


def _whole(block_hash: bytes) -> bytes:
    return block_hash


class PoolKVEvents(NoKVEvents):
    def __init__(self, publisher, table: PageTableView, int_hashes: bool = True) -> None:
        self.publisher = publisher
        self.table = table
        self.block_size = table.block_size
        self._wire = external_block_hash if int_hashes else _whole  # a hash as the events carry it

    def snapshot(self, rank: int, snapshot: KVSnapshot) -> None:
        self.publisher.cleared(rank)
        self._stored(rank, snapshot.blocks)
        self.publisher.flush()

    def delta(self, rank: int, delta: KVDelta) -> None:
        """Publish what ``delta`` changed; the page table has applied it already."""
        run: list[BlockStored] = []
        for event in delta.events:
            if type(event) is BlockStored:
                run.append(event)
                continue
            self._stored(rank, run)
            run = []
            wire = self._wire(event.block_hash)
            if self.publisher.announced(rank, wire) and self.table.generation(rank, event.block_hash) is None:
                self.publisher.removed(rank, [wire])
        self._stored(rank, run)
        self.publisher.flush()

    def _stored(self, rank: int, events: list[BlockStored]) -> None:
        """Publish new blocks, one ``BlockStored`` per run of blocks chained onto each other."""
        chain: list[BlockStored] = []
        for event in events:
            if self.publisher.announced(rank, self._wire(event.block_hash)):  # a newer copy: not news
                continue
            if chain and event.parent_hash != chain[-1].block_hash:
                self._publish_chain(rank, chain)
                chain = []
            chain.append(event)
        if chain:
            self._publish_chain(rank, chain)

    def _publish_chain(self, rank: int, chain: list[BlockStored]) -> None:
        parent = chain[0].parent_hash
        tokens = [t for event in chain for t in event.token_ids]
        self.publisher.stored(rank, [self._wire(e.block_hash) for e in chain],
                              None if parent == ROOT_HASH else self._wire(parent), tokens, self.block_size)

    def rank_down(self, rank: int) -> None:
        self.publisher.cleared(rank)
        self.publisher.flush()

    def close(self) -> None:
        self.publisher.close()
