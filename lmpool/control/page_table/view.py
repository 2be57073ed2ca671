"""What routing reads of the page table: each rank's load, reservations and cache size, the
alive ranks and the prefix match. Policies get only this view; the router alone writes
(reservations, demand, a rank's death), through ``GlobalBlockManager``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lmpool.control.page_table.reservations import RankReservations
from lmpool.protocol import LoadReport
from lmpool.protocol.base import BlockHash


class RankView(Protocol):
    @property
    def load(self) -> LoadReport: ...

    @property
    def num_ready(self) -> int: ...

    @property
    def num_entries(self) -> int: ...

    @property
    def reserved_blocks(self) -> int: ...

    @property
    def reserved_tokens(self) -> int: ...

    @property
    def num_reservations(self) -> int: ...

    @property
    def blocks_available(self) -> int: ...

    @property
    def in_flight_seqs(self) -> int: ...

    @property
    def reserved(self) -> RankReservations: ...


class PageTableView(Protocol):
    @property
    def world_size(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def alive_mask(self) -> int: ...

    @property
    def ranks(self) -> Sequence[RankView]: ...

    def prefix_match(self, block_hashes: list[BlockHash], candidates: int | None = None) -> list[int]: ...

    def branched_depth(self, chain: list[BlockHash]) -> int: ...

    def generation(self, rank: int, block_hash: BlockHash) -> int | None: ...
