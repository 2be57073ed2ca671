"""vLLM's KV-event wire types (``vllm.distributed.kv_events``), for publishing LMPool's events.

A ZMQ message is ``[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]``; a batch carries
the ``data_parallel_rank`` (here: the replica) its events happened on. Events are tagged
structs: ``BlockStored`` (chained block hashes, the parent of the first, the blocks' token
ids, the block size), ``BlockRemoved`` and ``AllBlocksCleared``.

Two layouts exist: the array layout (every struct a msgpack array, the event's tag first),
which vLLM's own subscriber example and most deployed consumers decode, and the map layout of
recent vLLM releases (events as maps with a ``type`` key). ``event_types(array_like)`` builds
either; the batch is an array in both.

A block hash on the wire is vLLM's ``ExternalBlockHash``: by default vLLM sends the low 64 bits
of its digest as an unsigned integer (``maybe_convert_block_hash``, on unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), and consumers such as NVIDIA Dynamo's KV router
decode only that form. ``external_block_hash`` is the same conversion of LMPool's 32-byte hashes.
"""

# No `from __future__ import annotations`: msgspec resolves these structs' field types, and
# they are local to ``event_types``.
from functools import cache
from typing import NamedTuple

import msgspec

MEDIUM_GPU = "GPU"
_LOW_64 = (1 << 64) - 1
# The replay socket's words (``control/kv_events/publisher.py`` answers them): the sequence
# number that ends a reply, and the request LMPool adds to vLLM's (a full snapshot instead of
# a replay from a sequence number).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot-request"


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it by default: the digest read big-endian, its low 64 bits
    (``int.from_bytes(digest, "big") & (2**64 - 1)``, vLLM's ``maybe_convert_block_hash``)."""
    return int.from_bytes(block_hash, "big") & _LOW_64


class EventTypes(NamedTuple):
    batch: type
    stored: type
    removed: type
    cleared: type


@cache
def event_types(array_like: bool = True) -> EventTypes:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    # No defaults on the fields older consumers require: omit_defaults would drop them.
    # Hashes are vLLM's ``ExternalBlockHash``: int (``external_block_hash``, the default) or bytes
    # (LMPool's whole 32-byte hashes).
    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return EventTypes(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)
