"""Chained content hashes of complete KV blocks: 256-bit, collision-resistant, salted per tenant.

``hash(block 0) = sha256(0x00 || len(salt) || salt || token ids of block 0)`` and
``hash(block i) = sha256(0x01 || hash(block i-1) || token ids of block i)``: the leading
byte keeps a first block's input apart from any later block's. A hash is 32 bytes
(``BlockHash``), so it travels in messages as msgpack bin and serves as an opaque key of
page tables; ``ROOT_HASH`` (empty, falsy like the integer 0 it replaces) stands for "no
parent". The value depends only on the salt and the token ids, so every process (workers,
control plane) computes the same hash for the same prefix; Python's ``hash()`` is salted
per process and must never be used here.

Tenant isolation, as vLLM's ``cache_salt``: the request's salt (``SamplingParams.cache_salt``)
enters the first block's hash and so, through the chain, every later one. Requests with
different salts never share a block, nor learn from a prefix hit, its timing, or a route,
that another tenant sent a prompt. Without a salt every request shares the cache: a
tenant can learn whether some unsalted request sent a given prefix (a hit shows in
``num_cached_tokens``, the time to first token and the route), though never its tokens
beyond the prefix it already guessed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from lmpool.protocol.base import BlockHash

HASH_BYTES = 32
ROOT_HASH: BlockHash = b""
# A hash in a msgpack message: bin 8 header (2 bytes) + the digest.
HASH_WIRE_BYTES = HASH_BYTES + 2

_FIRST, _CHILD = b"\x00", b"\x01"
_ID_BYTES = array("q").itemsize  # a token id as hashed: int64


def block_hash(parent: BlockHash, token_ids: list[int] | tuple[int, ...], salt: str | None = None) -> BlockHash:
    """The chained hash of one complete block following ``parent`` (``ROOT_HASH`` for the
    first block, which alone takes the ``salt``)."""
    return _hash(parent, array("q", token_ids), salt)


def _hash(parent: BlockHash, token_bytes, salt: str | None) -> BlockHash:
    """``block_hash`` of a block given as its int64 token ids' bytes."""
    h = hashlib.sha256()
    if parent == ROOT_HASH:
        salt_bytes = b"" if salt is None else salt.encode()
        h.update(_FIRST + len(salt_bytes).to_bytes(4, "little") + salt_bytes)
    else:
        h.update(_CHILD + parent)
    h.update(token_bytes)
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int] | array, block_size: int, start: list[BlockHash] | None = None,
    salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of every complete block of ``token_ids``, extending the known ``start`` hashes;
    ``salt`` (the request's ``cache_salt``) enters the first block's. The ids may come as the
    int64 array ``validation.check_prompt`` returns: they are then not converted again."""
    hashes = list(start or [])
    first, end = len(hashes), len(token_ids) // block_size
    if first >= end:
        return hashes
    # One conversion (none for an int64 array), then each block's bytes as a slice of it: what
    # ``block_hash`` hashes. A long prompt's conversion costs as much as its hashing.
    span = slice(first * block_size, end * block_size)
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        ids = memoryview(token_ids)[span].cast("B")
    else:
        ids = memoryview(array("q", token_ids[span])).cast("B")
    size = block_size * _ID_BYTES
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(end - first):
        parent = _hash(parent, ids[i * size : (i + 1) * size], salt)
        hashes.append(parent)
    return hashes


def short(h) -> str:
    """A block hash for messages and logs: its first 8 bytes in hex (tests may use ints)."""
    return h[:8].hex() if isinstance(h, bytes) else f"{h:#x}"
