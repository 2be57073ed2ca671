"""In-flight markers: per rank, the hashes a transfer is bringing there and has not published yet.

Each marker holds the block the transfer reserved (``generation << 32 | block_id``). The entry
table (``lmpool.control.page_table.entries``) keeps a marked hash out of the ready index, so
routing never counts it, and applies mark and unmark to the entries.

Invariant (checked by the page table): markers exist only on alive ranks. A marked hash may
have lost its entry meanwhile (a snapshot or removal): unmarking it then changes nothing.
"""

from __future__ import annotations

from lmpool.protocol.base import BlockHash


class InFlight:
    def __init__(self, world_size: int) -> None:
        self.ranks: list[dict[BlockHash, int]] = [{} for _ in range(world_size)]

    def clear(self, rank: int) -> None:
        self.ranks[rank].clear()
