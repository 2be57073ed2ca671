"""Route reservations: capacity and queue work a route promised a rank before the rank's own
reports show it. One per request; released when the rank reports the request admitted, when
the rank goes, or ``ttl_s`` after it was taken (its request never arrived). A reservation holds
what the request will add to the rank's load report once admitted: blocks, prompt tokens to
compute, their attention pairs and the keys they read, its context (the keys it reads on its own), the shared prefix
its decode steps attend in a cascade's prefix pass (``cascade``) and the tokens it will decode.
It names its request's cascade group (``head``: the last block hash of the prefix it shares with
other routed prompts, ``lmpool.control.pricing.price.group_key``): a rank's totals count the
reservations of each group (``heads``), the groups routed there and not yet reported, which
``RoutingConfig.cascade_groups`` prices a request's shared prefix by. A reservation is
``deferred`` while its request waits on a pull to its rank: its prefill cannot start before the
pull lands, and a rank's totals keep that part apart (``deferred_tokens``, ``deferred_attention``,
``deferred_keys``)
until the pull ends (``admissible``).

Invariants: each rank's totals are the sums of its reservations, its deferred totals those of
its deferred ones, its ``heads`` the count of its reservations of each head (none at 0); every
reservation can still expire (its id and creation time are in the expiry queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """One route's promise to its rank. A struct (built in C, untracked by the garbage
    collector): every route takes one."""

    request_id: str
    rank: int
    blocks: int
    tokens: int
    created: float
    attention: int = 0
    context: int = 0
    decode: int = 0
    deferred: bool = False  # its request waits on a pull to this rank
    cascade: int = 0  # shared prefix tokens its decode steps attend in a cascade's prefix pass
    head: bytes | None = None  # its request's group (``group_key``; None: it shares no prefix, or no groups)
    # The prefix tokens a lone member of its group there read alone and, joined by it, read in the
    # cascade's prefix pass from then on: the rank's context less these, its cascade pairs more.
    converted: int = 0
    keys: int = 0  # the keys its prefill reads (``LoadReport.prefill_keys``): its prompt, where it computes any


# The fields a rank's totals sum, in ``Reservation``'s names, and those it sums of deferred ones.
SUMMED = ("blocks", "tokens", "attention", "context", "decode", "cascade", "converted", "keys")
DEFERRED = ("deferred_tokens", "deferred_attention", "deferred_keys")


class RankReservations:
    __slots__ = ("blocks", "tokens", "attention", "context", "decode", "cascade", "converted", "keys", "count",
                 "deferred_tokens", "deferred_attention", "deferred_keys", "version", "heads")

    def __init__(self) -> None:
        self.blocks = self.tokens = self.attention = self.context = self.decode = self.cascade = self.count = 0
        self.converted = self.keys = 0
        # Of ``tokens``, ``attention`` and ``keys``: waiting on pulls.
        self.deferred_tokens = self.deferred_attention = self.deferred_keys = 0
        self.version = 0  # every change adds one: what was priced from the totals knows when they moved
        self.heads: dict[bytes, int] = {}  # group key -> reservations of it (a group at 0 leaves)

    def add(self, r: Reservation, sign: int) -> None:
        self.version += 1
        self.blocks += sign * r.blocks
        self.tokens += sign * r.tokens
        self.attention += sign * r.attention
        self.context += sign * r.context
        self.decode += sign * r.decode
        self.cascade += sign * r.cascade
        self.converted += sign * r.converted
        self.keys += sign * r.keys
        self.count += sign
        if r.deferred:
            self.deferred_tokens += sign * r.tokens
            self.deferred_attention += sign * r.attention
            self.deferred_keys += sign * r.keys
        if r.head is not None:
            rows = self.heads.get(r.head, 0) + sign
            if rows:
                self.heads[r.head] = rows
            else:
                del self.heads[r.head]


class Reservations:
    def __init__(self, world_size: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.by_id: dict[str, Reservation] = {}
        self.totals = [RankReservations() for _ in range(world_size)]
        # Reservations in creation order, for TTL expiry without a scan; released ones are
        # skipped when they reach the front.
        self._expiry: deque[tuple[float, str]] = deque()

    def reserve(self, request_id: str, rank: int, blocks: int, tokens: int, attention: int = 0, context: int = 0,
                decode: int = 0, deferred: bool = False, cascade: int = 0, head: bytes | None = None,
                converted: int = 0, keys: int = 0) -> None:
        if min(blocks, tokens, attention, context, decode, cascade, converted, keys) < 0:
            raise ValueError(f"reservation of {blocks} blocks, {tokens} tokens, {attention} pairs, {context} context, "
                             f"{decode} decode tokens, {cascade} cascade pairs, {converted} converted, {keys} keys: "
                             "all must be >= 0")
        self.release(request_id)  # a re-routed request holds one reservation, not two
        now = self.clock()
        reservation = Reservation(request_id, rank, blocks, tokens, now, attention, context, decode, deferred, cascade,
                                  head, converted, keys)
        self.by_id[request_id] = reservation
        self._expiry.append((now, request_id))
        self.totals[rank].add(reservation, 1)

    def release(self, request_id: str) -> bool:
        reservation = self.by_id.pop(request_id, None)
        if reservation is None:
            return False
        self.totals[reservation.rank].add(reservation, -1)
        return True

    def admissible(self, request_id: str) -> None:
        """The pull ``request_id`` waited on has ended: its work may start (no longer deferred)."""
        reservation = self.by_id.get(request_id)
        if reservation is None or not reservation.deferred:
            return
        now_admissible = msgspec.structs.replace(reservation, deferred=False)  # its creation time: it still expires
        self.by_id[request_id] = now_admissible
        totals = self.totals[reservation.rank]
        totals.add(reservation, -1)
        totals.add(now_admissible, 1)

    def release_admitted(self, rank: int, admitted: list[str]) -> None:
        """``rank`` admitted these requests: their reservations there are spent."""
        for request_id in admitted:
            reservation = self.by_id.get(request_id)
            if reservation is not None and reservation.rank == rank:
                self.release(request_id)

    def expire(self) -> int:
        """Release reservations older than the TTL; how many."""
        deadline = self.clock() - self.ttl_s
        expired = 0
        while self._expiry and self._expiry[0][0] <= deadline:
            created, request_id = self._expiry.popleft()
            reservation = self.by_id.get(request_id)
            if reservation is not None and reservation.created == created:
                self.release(request_id)
                expired += 1
        return expired

    def drop_rank(self, rank: int) -> None:
        if self.totals[rank].count:
            for request_id in [r.request_id for r in self.by_id.values() if r.rank == rank]:
                self.release(request_id)

    def check(self) -> None:
        totals = [RankReservations() for _ in self.totals]
        for request_id, reservation in self.by_id.items():
            assert reservation.request_id == request_id
            totals[reservation.rank].add(reservation, 1)
        for rank, (own, summed) in enumerate(zip(self.totals, totals)):
            for name in (*SUMMED, *DEFERRED, "count", "heads"):  # (not the version: a count of changes, not a sum)
                assert getattr(own, name) == getattr(summed, name), f"rank {rank}: reservation totals ({name})"
        pending = {request_id for _, request_id in self._expiry}
        assert self.by_id.keys() <= pending, "a reservation cannot expire"
