"""Chained content hashes of complete KV blocks.

``hash(block i) = blake2b-64(hash(block i-1) || token ids of block i)``, with the
first block chained to ``ROOT_HASH``. The value depends only on the token ids, so
every process (workers, control plane) computes the same hash for the same
prefix; Python's ``hash()`` is salted per process and must never be used here.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0


def block_hash(parent: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """The 64-bit chained hash of one complete block following ``parent``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(
    token_ids: list[int], block_size: int, start: list[int] | None = None
) -> list[int]:
    """Hashes of every complete block of ``token_ids``, extending the known ``start`` hashes."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
