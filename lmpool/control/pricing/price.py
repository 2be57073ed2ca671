"""What a request costs on each rank, in predicted seconds, from each rank's fitted step time.

A rank's in-flight work is its last load report plus its route reservations: ``n`` sequences
(running, waiting, reserved; at most ``max_num_seqs`` run), their ``ctx`` context tokens (read
each on its own) and ``cp`` cascade pairs (the shared prefixes they attend in a cascade's prefix
passes), ``left`` tokens still to decode, and ``W`` prompt tokens still to prefill (each queued
prompt less the prefix cached on its arrival, ``LoadReport.new_prefill_tokens``; ``Aw`` attention
pairs; ``Kw`` keys their chunks read, each prompt's whole context). With the rank's
step coefficients (base, per prefill token, per attention pair, per prefill key, per decoding
sequence ``seq``, per context token ``tok``, per cascade pair ``cpair``), a
step beside the decodes costs ``step = base + seq * n + tok * ctx + cpair * cp``, and takes at
most ``room = chunk - n`` prefill tokens.
(The requests routed there before it arrive there before it too, so its steps count them.)
For a request of ``P`` prompt tokens, ``m`` of them cached there, ``p = P - m`` to compute
(``a`` attention pairs) and ``M`` tokens to generate:

    queue  = ceil(W / room) * step + prefill_token * W + attention_pair * Aw + prefill_key * Kw   (0 when W = 0)
    start  = ceil((W + p) / room) * step + prefill_token * W + attention_pair * Aw + prefill_key * Kw
             # the queued prefill and the request's own are packed into the same steps: a short
             # prompt behind a short queue shares its step (a burst's questions do)
    own    = prefill_token * p + attention_pair * a + prefill_key * P     (``prefill_seconds``; 0 when p = 0)
    seat   = the wait for a free sequence slot when n >= max_num_seqs
    room_s = the wait for blocks when the rank lacks them now: until enough of its running
             sequences finish to release the shortfall (each holding its share of the used blocks)
    busy   = step when anything runs there: the step under way, which a new request waits for;
             two steps when the rank steps overlapped (``async_scheduling`` on a GPU): the step after it
             is already launched when the request arrives, so its first step is the one after;
             plus the prefill that launched step computes (``L`` tokens, ``Al`` pairs, as the
             worker reports it: ``prefill_token * L + attention_pair * Al``), which has left
             the rank's queue but not its device: a burst's questions admitted together (not
             where the request waits on a copy: the copy ran behind that prefill, and its wait
             counts it, as the step under way there, ``next_step_s``)
    ttft   = max(start, wait + deferred, room_s + ceil(p / room) * step) + own + seat + busy
             # wait: a copy the request waits on (a pull); deferred: that wait, then the reserved
             # work there that waits on pulls too (``D`` of the ``W`` tokens, ``Ad`` of the pairs)
             # packed with the request's own, as in ``start``: ``ceil((D + p) / room) * step +
             # prefill_token * D + attention_pair * Ad`` (counted only when the request waits on
             # a copy: such work starts once the copies land)
    decode = (M - 1) * (base + mine) + overlap * theirs
    harm   = overlap * mine + n * own
    evict  = reclaim blocks * the recompute of one * the rank's measured reuse (``eviction``)
    join   = with ``Limits.cascade_groups``, where the request's group there is one sequence, which
             reads the prefix alone until a second joins it (the engine groups no single row):
             2 * (tok - cpair) * s * min(M - 1, left / seqs), what that member's steps and the
             request's own save once both read it in the prefix pass (``Reservation.converted``)
    total  = max(ttft, ttft + decode + harm - join) + evict

where ``mine = seq + tok * (P + M / 2)`` is what the request adds to each step it decodes in
(``seq + tok * (P - s + M / 2) + cpair * s`` when the ranks decode shared prefixes once, ``s`` the
tokens it found cached there that other routed prompts share too, the chain's branched depth: a
burst's document is read once for all of its questions, in a prefix pass that attends each of
them to it, while a conversation's own history is read by it alone; with
``Limits.cascade_groups``, only on a rank where a sequence of the request's group, in its last load
report or routed there since, makes a group for it to join: elsewhere it reads its whole context
alone, so a document's questions are priced cheaper where it is decoded already. A request's group
is keyed by the last block of that shared prefix (``group_key``), assigned when it is routed and
echoed by its worker: documents behind one shared system-prompt block are groups of their own, as
the engine's cascade plans group them),
``theirs = seq + (tok * ctx + cpair * cp) / n`` what one co-running sequence adds, and ``overlap = min(n *
(M - 1), left)`` the steps they share. ``total`` is the request's own latency plus the delay it
causes the sequences already there: what a route minimises. Reclaim is the new blocks it needs
beyond the free ones (reservations take free blocks first). A rank is feasible when its free and
reclaimable blocks and the blocks its sequences hold (running there, or reserved for requests
routed there; released as they finish) hold them: it has that many blocks in all. It is short
when its free and reclaimable blocks, less reservations, do not, and then it waits (``room_s``):
k of its h holding sequences, k enough to release the shortfall at their mean share, finish
after about 2 k / h of their mean decode left, as for a seat. A rank short of blocks is a
queue, not a wall: it is priced, not excluded.

Invariants: every price and time is finite and >= 0, the time to first token at least one
step's base, the total at least the time to first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import msgspec

from lmpool.control.page_table.reservations import RankReservations
from lmpool.control.page_table.view import PageTableView
from lmpool.control.pricing.engine_model import EngineModel
from lmpool.control.pricing.step_model import StepCoefficients
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.base import BlockHash, attention_pairs, prefill_keys


class RankPrice(msgspec.Struct, frozen=True, gc=False):
    """One candidate's prediction for one request (seconds). A struct, not a named tuple: a route
    builds one per candidate, and a struct is built in C (a named tuple's ``__new__`` is Python);
    untracked by the garbage collector, as it holds numbers only."""

    rank: int
    matched: int  # usable matched blocks
    missing: int  # prompt tokens to compute
    need: int  # new blocks the request would hold
    available: int  # free + reclaimable - reserved blocks: room now
    free: int  # free - reserved blocks: room without evicting
    seqs: int  # requests in flight there: the bounded-load gate's load
    ttft_s: float
    total_s: float
    affinity: int  # to the seed rank
    held: int = 0  # blocks its sequences hold or have reserved: room once they finish
    joins: bool = False  # with ``Limits.cascade_groups``: a sequence of its group is there to read its prefix with
    # Two parts of ``ttft_s``: the wait for the step under way (``busy``) and its own prefill's compute
    # (``own``); the rest is its wait for the queue ahead, a copy, blocks or a seat, and its own prefill's
    # steps. Only the route records read them.
    busy_s: float = 0.0
    own_s: float = 0.0

    @property
    def feasible(self) -> bool:
        """The rank can hold the request, now or once its sequences finish."""
        return self.available + self.held >= self.need

    @property
    def short(self) -> bool:
        """The rank lacks the request's blocks now: it waits for running sequences to finish."""
        return self.available < self.need


class Limits(NamedTuple):
    """What every rank's scheduler allows (the pool's engine settings)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # ``EngineConfig.async_scheduling`` on a GPU: a step is launched before the last is read (a CPU
    # rank's worker reads each step before the next launch: ``EngineCore.read_finished``)
    overlapped: bool = True
    # The key reads a decode step's shared prefixes must save for the ranks to read them once
    # (``lmpool.engine.cascade``; ``config.engine.cascade_min_saved``, 0: never): where enough
    # sequences share it, a request's cached shared prefix is not its own reading.
    cascade_min_saved: int = 0
    # How pricing reads cascades (``RoutingConfig.cascade_groups``): a request's shared prefix is read
    # once only on a rank whose sequences, reported or reserved, are of its group (``group_key``: its
    # shared prefix's last block). Off: on any rank whose sequences in flight, whatever their
    # prefixes, could save a cascade's worth with it. On, as the routing config's default.
    cascade_groups: bool = True


NO_HEADS: dict[bytes, int] = {}  # a rank's groups where pricing does not read them (never written)


def group_key(chain: list[BlockHash], depth: int) -> BlockHash | None:
    """The cascade group of a request of block hashes ``chain`` whose leading ``depth`` blocks make
    its group's prefix (``group_depth``): that prefix's last block hash, None where it has none.
    Documents behind one system-prompt block key apart, as the engine's cascade plans group their
    rows (``lmpool.engine.cascade``)."""
    return chain[depth - 1] if depth else None


def group_depth(chain: list[BlockHash], branched: int, held: int) -> int:
    """Where the cascade group of a request of block hashes ``chain`` ends, in blocks: the deepest
    of its ``branched`` depth (``PageTableView.branched_depth``) and the ``held`` blocks some
    candidate holds or will (``Route.expected``). A document's first questions share it before
    any branches from it (their group is the document's, not a system prompt's above it); a
    conversation's turn names its own history, a group of one, and shares no prompt's prefix in
    the price (where the ranks' cascades read its preamble once, the price misses that)."""
    return max(branched, min(held, len(chain)))


def read_once(shared: int, sequences: int, cascade_min_saved: int) -> int:
    """Of a request's ``shared`` cached prefix tokens, those its rank reads once for it: all of them
    where the ``sequences`` in flight there could save a cascade's worth of key reads with it
    (``Limits.cascade_min_saved``), else none."""
    return shared if shared * sequences >= cascade_min_saved else 0


class QueryTerms(msgspec.Struct, frozen=True, gc=False):
    """What pricing reads of a request, the same on every rank: computed once per route
    (``Pricer.terms``), not once per candidate."""

    prompt: int  # P
    out: int  # M, at least 1
    blocks: int  # the blocks its sequence fills, nothing cached: ceil((P + M) / block size)
    usable: int  # matched blocks it can use: the worker recomputes the last prompt token
    span: float  # P + M / 2: the mean context of its decode steps
    # With cascades, the leading tokens of its prompt that other routed prompts share (the chain's
    # branched depth): ranks that decode shared prefixes once read those once for it; 0 without.
    shared: int = 0
    head: bytes | None = None  # its group (``group_key``), where ``Limits.cascade_groups`` reads it; else None


class RankWork(NamedTuple):
    """What a rank has in flight, priced once for every request routed until it changes (its
    load report, its reservations or its fit): the module docstring's query-free terms."""

    key: tuple  # what it was computed from: the load report, the fit and the reservations' version
    c: StepCoefficients
    seqs: int
    n: int
    left: int
    step: float
    room: int
    queue: float  # seconds of the queued prefill (the module docstring's ``queue``)
    seat: float
    theirs: float
    free: int  # blocks free, less reservations
    available: int
    busy: float  # what a new request waits for: one step when any runs, two when overlapped; a launched prefill
    next_step: float  # the step a message arriving now waits for: ``step`` and the prefill launched with it
    # (or, none launched, its share of the queued prefill)
    holders: int  # sequences holding blocks: running, and routed here (reserved) but not yet admitted
    held: int  # the blocks they hold or have reserved, released as they finish
    drain: float  # seconds until a sequence's mean decode left is done
    queued: int  # W: prompt tokens queued to prefill
    queue_work: float  # their prefill and attention seconds, without the steps they take
    deferred: int  # D: those of the W whose requests wait on pulls (start once they land)
    deferred_work: float  # their prefill and attention seconds
    landed_busy: float  # ``busy`` for a request that arrives once a copy has landed: the launched prefill done
    # With ``Limits.cascade_groups``: sequences by group (``group_key``), in the load report (built
    # once per report) and routed there since (the reservations' own counts); else empty.
    heads: dict[bytes, int]
    reserved_heads: dict[bytes, int]

    def sharing(self, head: bytes | None) -> int:
        """Sequences there of group ``head``: the cascade group a request of it joins there."""
        return self.heads.get(head, 0) + self.reserved_heads.get(head, 0)  # type: ignore[arg-type]


class Pricer:
    def __init__(self, table: PageTableView, topology: Topology, model: EngineModel, limits: Limits,
                 reuse: Callable[[int], float]) -> None:
        self.table = table
        self.topology = topology
        self.model = model
        self.limits = limits
        self._cascades = limits.cascade_min_saved > 0  # read by every route's terms
        self._groups = self._cascades and limits.cascade_groups
        self.reuse = reuse  # a rank's measured reuse of what it evicts
        self._work: list[RankWork | None] = [None] * table.world_size  # by rank (``work``)

    def serve(self, query: RouteQuery, ranks: Sequence[int], matched: list[int], seed: int | None,
              waits: dict[int, float] | None = None) -> list[RankPrice]:
        """Each rank of ``ranks`` serving ``query`` from the ``matched[r]`` blocks it will hold
        (``waits[r]`` seconds from now, where a pull is bringing some)."""
        terms = self.terms(query, max(matched))  # once for every candidate
        usable, waits, price, work = terms.usable, waits or {}, self.price_work, self.work
        return [price(terms, work(r), r, usable if matched[r] > usable else matched[r], waits.get(r, 0.0), seed, 0)
                for r in ranks]

    def terms(self, query: RouteQuery, held: int = 0) -> QueryTerms:
        """What every rank's price reads of ``query``; ``held``: the most of its blocks a candidate
        holds or will (``Route.expected``), which its group reads (``group_depth``)."""
        prompt, out = query.num_prompt_tokens, query.max_tokens if query.max_tokens > 1 else 1
        block_size = self.limits.block_size
        chain, head = query.block_hashes, None
        depth = self.table.branched_depth(chain) if self._cascades else 0
        if self._groups:
            depth = group_depth(chain, depth, held)
            head = group_key(chain, depth)
        return QueryTerms(prompt, out, -(-(prompt + out) // block_size), max(0, (prompt - 1) // block_size),
                          prompt + out / 2, depth * block_size, head)

    def work(self, rank: int) -> RankWork:
        """``rank``'s in-flight work, recomputed only when what it is computed from changed: its
        load report (a new object per report), its reservations' version (moved by every change)
        or its step fit (a new object per fit)."""
        info = self.table.ranks[rank]
        work = self._work[rank]
        if work is not None:
            load, c, version = work.key
            if version == info.reserved.version and load is info.load and c is self.model.coefficients(rank):
                return work
        heads = work.heads if work is not None and work.key[0] is info.load else None  # the same report's
        work = self._work[rank] = self._compute_work(info.load, info.reserved, self.model.coefficients(rank), heads)
        return work

    def sharing(self, rank: int, head: bytes | None) -> int:
        """Sequences on ``rank`` of group ``head`` (``group_key``), reported or reserved
        (``RankWork.sharing``): with ``Limits.cascade_groups``, whether a request of that group
        reads its shared prefix once there."""
        return self.work(rank).sharing(head)

    def reported(self, rank: int) -> None:
        """``rank``'s load report landed: its work is priced now, between routes, not by the next
        route (after a batch of reports, that route would price every rank's)."""
        self.work(rank)

    def _compute_work(self, load: LoadReport, res: RankReservations, c: StepCoefficients,
                      heads: dict[bytes, int] | None = None) -> RankWork:
        """The module docstring's query-free terms of a rank with ``load`` as reported,
        reservations ``res`` and step fit ``c`` (``heads``: ``load``'s groups, where already built)."""
        lim = self.limits
        seqs = load.num_running + load.num_waiting + res.count
        n = min(seqs, lim.max_num_seqs)
        # A join converts its group's lone member: its prefix leaves the keys read alone for the pass.
        ctx = max(0, load.context_tokens + res.context - res.converted)
        left = load.decode_tokens_left + res.decode
        reads = c.context_token * ctx + c.cascade_pair * (load.cascade_pairs + res.cascade + res.converted)
        step = c.base + c.decode_seq * n + reads
        room = max(1, lim.max_num_batched_tokens - n)
        # What the queued prompts will compute: each less the prefix cached on its arrival, as its
        # reservation counted it (every uncomputed token, ``waiting_prefill_tokens``, counts a
        # burst's waiting questions' whole document as prefill once their report lands).
        queued = load.new_prefill_tokens + res.tokens
        attention = load.prefill_attention + res.attention
        keys = load.prefill_keys + res.keys
        queue_work = c.prefill_token * queued + c.attention_pair * attention + c.prefill_key * keys
        queue = queue_work + -(-queued // room) * step
        launched = (c.prefill_token * load.launched_prefill_tokens + c.attention_pair * load.launched_attention
                    + c.prefill_key * load.launched_keys)
        next_step = step if seqs else 0.0
        if load.launched_prefill_tokens:  # the step under way is the one launched with that prefill
            next_step = step + launched
        elif queued > 0:  # ... else its share of the queued prefill, where any is queued
            chunk = min(queued, room)
            share = chunk / queued
            next_step = step + c.prefill_token * chunk + (c.attention_pair * attention + c.prefill_key * keys) * share
        deferred = res.deferred_tokens
        deferred_work = (c.prefill_token * deferred + c.attention_pair * res.deferred_attention
                         + c.prefill_key * res.deferred_keys)
        seat = 0.0
        if seqs >= lim.max_num_seqs:  # k of n finish first after about 2 k / n of their mean left
            seat = min(1.0, 2.0 * (seqs - lim.max_num_seqs + 1) / seqs) * (left / seqs) * step
        theirs = c.decode_seq + reads / n if n else 0.0
        free = load.blocks_free - res.blocks
        landed_busy = (2.0 * step if lim.overlapped else step) if seqs else 0.0
        busy = landed_busy
        if load.launched_prefill_tokens:  # a one-token request leaves ``running`` at its launch
            busy = (2.0 * step if lim.overlapped else step) + launched
        drain = (left / seqs) * step if seqs else 0.0
        if not self._groups:
            heads, reserved_heads = NO_HEADS, NO_HEADS
        else:
            heads = dict(zip(load.group_heads, load.group_rows)) if heads is None else heads
            reserved_heads = res.heads  # moved with the reservations' version, which keys this work
        return RankWork((load, c, res.version), c, seqs, n, left, step, room, queue, seat, theirs, free,
                        free + load.blocks_reclaimable, busy, next_step, load.num_running + res.count,
                        load.blocks_used + res.blocks, drain, queued, queue_work, deferred, deferred_work,
                        landed_busy, heads, reserved_heads)

    def price(self, query: RouteQuery, rank: int, m: int, wait_s: float, seed: int | None,
              arriving: int = 0) -> RankPrice:
        """``query`` on ``rank`` holding ``m`` usable blocks once ``wait_s`` seconds have passed,
        ``arriving`` of them copied there first (they need room there too). Its cascade group, with
        ``Limits.cascade_groups``, is its branched depth's alone (``terms`` without ``held``): a
        route's prices read what its candidates hold (``serve``)."""
        return self.price_terms(self.terms(query), rank, m, wait_s, seed, arriving)

    def price_terms(self, q: QueryTerms, rank: int, m: int, wait_s: float, seed: int | None,
                    arriving: int) -> RankPrice:
        """``price``, from the request's terms (``terms``): what a route prices every candidate with."""
        return self.price_work(q, self.work(rank), rank, m, wait_s, seed, arriving)

    def price_work(self, q: QueryTerms, w: RankWork, rank: int, m: int, wait_s: float, seed: int | None,
                   arriving: int) -> RankPrice:
        """``price_terms`` from ``rank``'s work ``w`` (``work(rank)``, read this route): a caller
        that reads the work for more than the price reads it once."""
        (_, c, seqs, n, left, step, room, _, seat, theirs, free, available, busy, _, _, held, _, queued,
         queue_work, deferred, deferred_work, landed_busy, _, _) = w
        # One unpack, not a lookup per use.
        base, prefill_token, attention_pair, decode_seq, context_token, cascade_pair, prefill_key = c
        prompt, out = q.prompt, q.out
        missing = prompt - m * self.limits.block_size
        need = q.blocks - m + arriving
        # ``prefill_seconds(c, missing, prompt - missing)``, the same arithmetic inlined: every
        # candidate of every route runs it, and two calls cost more than the sums.
        cached = prompt - missing
        prefill = prefill_token * missing + attention_pair * (missing * cached + missing * (missing + 1) // 2)
        if missing > 0:
            prefill += prefill_key * prompt
        own_steps = -(-missing // room) * step
        start = queue_work + -(-(queued + missing) // room) * step  # its prefill packed behind the queue's
        if wait_s:  # a copy first, then the others waiting on pulls, packed with its own
            landed = wait_s + (deferred_work + -(-(deferred + missing) // room) * step if deferred else own_steps)
            if landed > start:
                start = landed
            busy = landed_busy  # the copy ran behind the launched prefill (its wait counts it): done by then
        if need > available and held:
            room_s = self._room_s(w, need - available) + own_steps
            if room_s > start:
                start = room_s
        ttft = start + prefill + seat + busy
        # ``read_once(q.shared, n, ...)``, or with groups ``w.sharing(q.head)``: inlined as the rest of
        # this function is (two lookups at most, and only for a prompt sharing a prefix).
        shared = q.shared
        lone = joins = False  # its group there is one sequence, which reads the prefix alone until it joins
        if shared:
            if self._groups:
                members = w.heads.get(q.head, 0) + w.reserved_heads.get(q.head, 0)  # type: ignore[arg-type]
                if not members:
                    shared = 0  # no group there to join: it reads its whole context alone
                lone = members == 1
                joins = members > 0
            elif shared * n < self.limits.cascade_min_saved:
                shared = 0
        if cached < shared:
            shared = cached
        mine = decode_seq + context_token * (q.span - shared) + cascade_pair * shared
        overlap = n * (out - 1)
        if overlap > left:
            overlap = left
        total = ttft + (out - 1) * (base + mine) + overlap * (theirs + mine) + n * prefill
        if lone:  # ``converted``: the member's steps and its own, shared, read that prefix once from then on
            together = left / seqs if left < seqs * (out - 1) else out - 1
            total -= 2.0 * (context_token - cascade_pair) * shared * together
            if total < ttft:
                total = ttft
        reclaim = need - free if free > 0 else need
        if reclaim > 0:
            total += reclaim * self._block_recompute_s(c, prompt) * self.reuse(rank)
        near = 0 if seed is None else self.topology.affinity(seed, rank)
        return RankPrice(rank, m, missing, need if need > 0 else 0, available, free, seqs, ttft, total, near, held,
                         joins, busy, prefill)

    @staticmethod
    def _room_s(w: RankWork, short: int) -> float:
        """Seconds until ``short`` more blocks are released on a rank whose sequences hold
        ``w.held``: the first k to finish, k enough at their mean share, as for a seat."""
        if not w.holders:
            return w.drain
        k = -(-short * w.holders // w.held)
        return min(1.0, 2.0 * k / w.holders) * w.drain

    def _block_recompute_s(self, c: StepCoefficients, context: int) -> float:
        """One block's prefill at a context like the request's: what a regretted eviction costs
        (no keys: a chunk reads its context once for all of its blocks)."""
        b = self.limits.block_size
        return c.prefill_token * b + c.attention_pair * b * (context / 2 + b / 2)

    def prefill_s(self, rank: int, tokens: int, context: int = 0) -> float:
        """Seconds ``rank`` computes ``tokens`` prompt tokens in, after ``context`` cached ones."""
        return prefill_seconds(self.model.coefficients(rank), tokens, context)

    def prefill_s_per_token(self, rank: int) -> float:
        """A block's prefill seconds per token, at one block of context (the transfer gates' unit)."""
        b = self.limits.block_size
        return self.prefill_s(rank, b, b) / b

    def next_step_s(self, rank: int) -> float:
        """Seconds until the step under way at ``rank`` ends (0 when the rank is idle): what a
        transfer's phase waits for where workers read orders between steps, and what a copy into
        the rank runs behind."""
        return self.work(rank).next_step

    def load_s(self, rank: int) -> float:
        """Seconds until ``rank`` has done the work in flight there: its queued prefill, then its
        sequences' mean decode left (placement's load)."""
        w = self.work(rank)
        return w.queue + (w.step * w.left / w.seqs if w.seqs else 0.0)


def cheapest(prices: Iterable[RankPrice], tie: float) -> RankPrice:
    """The cheapest of ``prices``, counting those within ``tie`` of its price as equal: among
    them, higher topology affinity to the seed, a longer match, joining the request's cascade
    group (``RankPrice.joins``), fewer sequences in flight (running, waiting and reserved), more
    free blocks, then the lower price and rank. Prices this close are ones the model cannot tell
    apart, so a burst over twin ranks splits by count, not by whichever twin's estimate happens
    to be lower (a replica given one decoding sequence more than its twin ends the burst last).
    The group comes before the count: a second group opened on a rank costs every later step
    there a prefix pass, for every request that joins it, which no one price sees
    (``docs/ARCHITECTURE.md``). Free blocks decide between ranks with as many (idle ones, say):
    an emptier cache evicts less, and a cache holding content nothing has asked for yet is
    likely to be asked for it (a document read there, whose questions are coming)."""
    prices = list(prices)
    bound = min([p.total_s for p in prices]) * (1.0 + tie)
    best: RankPrice | None = None
    best_key: tuple[int, int, bool, int, int, float, int] | None = None
    for p in prices:  # ``min`` by that key, without a key function call per price
        if p.total_s <= bound:
            key = (-p.affinity, -p.matched, not p.joins, p.seqs, -p.free, p.total_s, p.rank)
            if best_key is None or key < best_key:
                best, best_key = p, key
    assert best is not None  # the cheapest price is within its own bound
    return best


def request_shape(query: RouteQuery, matched: int, block_size: int) -> tuple[int, int, int]:
    """(usable matched blocks, prompt tokens to compute, new blocks to hold) on a rank matching ``matched``.

    The worker recomputes the last prompt token to get logits, so a fully cached
    prompt still computes its final block (``BlockManager.match_prefix``).
    """
    prompt = query.num_prompt_tokens
    m = min(matched, max(0, (prompt - 1) // block_size))
    need = max(0, -(-(prompt + max(1, query.max_tokens)) // block_size) - m)
    return m, prompt - m * block_size, need


def prefill_seconds(c: StepCoefficients, tokens: int, context: int) -> float:
    """Seconds a rank of step coefficients ``c`` computes ``tokens`` prompt tokens in, after
    ``context`` cached ones."""
    return (c.prefill_token * tokens + c.attention_pair * attention_pairs(tokens, context)
            + c.prefill_key * prefill_keys(tokens, context))


def describe(rule: str, p: RankPrice) -> str:
    """A decision's reason: the rule that decided, the rank, its matched blocks, its predicted
    time to first token and its price, then two of that time's parts, the wait for the step under
    way and its own prefill (milliseconds)."""
    return (f"{rule} r{p.rank} m{p.matched} ttft={p.ttft_s * 1e3:.1f}ms price={p.total_s * 1e3:.1f}ms "
            f"busy={p.busy_s * 1e3:.1f}ms own={p.own_s * 1e3:.1f}ms")
