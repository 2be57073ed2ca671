"""Versioned reports of a replica's prefix cache, for the control plane's page table.

Every event advances the block manager's ``version`` by exactly one, so a
consumer that applied versions up to ``v`` can apply a delta only if its
``from_version == v``; anything else is a gap and calls for a full snapshot.
"""

from __future__ import annotations

import msgspec

from lmpool.protocol.base import BlockHash


class BlockStored(msgspec.Struct, tag="stored", array_like=True, gc=False, frozen=True):
    """A complete block became cached (its KV is fully written). ``token_ids`` are the block's
    tokens, for consumers outside the pool (vLLM-format KV events need them)."""

    block_hash: BlockHash
    parent_hash: BlockHash
    block_id: int
    generation: int
    token_ids: tuple[int, ...] = ()


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True, gc=False, frozen=True):
    """A cached block was reclaimed; its id may be reused under a new generation."""

    block_hash: BlockHash
    block_id: int
    generation: int


KVEvent = BlockStored | BlockRemoved


class KVDelta(msgspec.Struct, array_like=True, gc=False, frozen=True):
    from_version: int
    to_version: int
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Every cached block at ``version``, parents before children."""

    version: int
    blocks: list[BlockStored]
