"""Route-time pull options: the price of serving a request on a rank after copying its prefix there.

A pull brings to rank r the k blocks of the prompt that the best holder s (the longest ready
match, then the fewest requests in flight) has ready and r lacks; r then serves the request
from s's depth. Its price is the pricer's for r holding those blocks once the copy has landed
(``Pricer.price``: the copy runs while r's queue drains):

    pull_r = price(r, matched = s's depth, wait = copy_s(s -> r, k) + steps)
    steps  = max(held(s), held(r)) + step_s(r) + held(r)

``copy_s`` is the transfer cost model's estimate (its profile, corrected by the plans it saw);
``step_s`` the step each participant has under way (``Pricer.next_step_s``). A pull lands after
three rounds of messages: both sides prepare, the destination copies (over CUDA IPC it reads the
source's blocks, and the source is not waited for), the destination publishes. ``held(x)`` is
how long an order waits at x: nothing where workers serve orders while a step runs (CUDA ranks;
a source only under overlapped stepping, whose cached blocks are complete), else x's step under
way (CPU ranks read orders between steps). The copy itself runs on the destination's compute
stream, behind its step under way, so that step counts either way.

A pull is priced only where it can run and could win: r and s are topology partners, r has no
pending prefix or pull under way for the prompt (its expected match is its ready one), none of
the k blocks is in flight to r, r has room for the request's blocks (free + reclaimable, less
reservations and incoming plans), and r's serve price less all the pulled blocks could save
there is below the route's choice (a copy estimate costs the route time for nothing else).
Invariants: a pull brings k >= 1 blocks, all ready on its source, never past the prompt's last
usable block; its price is for a candidate rank.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Pricer, RankPrice, RankWork
from lmpool.control.routing.route import Route
from lmpool.control.topology import Topology


class PullOption(msgspec.Struct, frozen=True, gc=False):
    """One priced pull. A struct, built in C (a named tuple's constructor is Python): a route
    builds one per option; untracked by the garbage collector (it holds a price and numbers)."""

    price: RankPrice  # serving on the destination once the blocks have landed
    src: int
    start: int  # the destination's ready match: the first block the pull brings
    blocks: int
    copy_s: float  # the copy's estimated seconds, the participants' steps included
    steps_s: float  # ... of which the participants' steps


class PullPricer:
    def __init__(self, gbm: GlobalBlockManager, topology: Topology, pricer: Pricer,
                 estimate_s: Callable[[int, int, int], float], room: Callable[[int], int],
                 source_held: bool = True, dest_held: bool = True) -> None:
        """``source_held``/``dest_held``: whether a plan's order waits for the step under way at
        the source/destination (the module docstring's ``held``)."""
        self.source_held, self.dest_held = source_held, dest_held
        self.gbm = gbm
        self.topology = topology
        self.pricer = pricer
        self.estimate_s = estimate_s
        self.room = room

    def options(self, route: Route) -> list[PullOption]:
        """A pull to each candidate that could take one (module docstring)."""
        query, ready, expected = route.query, route.ready, route.expected
        usable = min(len(query.block_hashes), max(0, (query.num_prompt_tokens - 1) // self.gbm.block_size))
        # The source's depth is the longest ready match: a rank below it, with nothing pending or
        # arriving for the prompt, is the only kind that could take a pull. Most routes have none
        # (a miss, or every holder matching alike), and end here before any source is chosen.
        deepest = max(ready)  # a rank that is no candidate matches 0 (``prefix_match``)
        top = min(deepest, usable)
        takers = [r for r in route.ranks if ready[r] < top and expected[r] == ready[r]]
        if not takers:
            return []
        infos = self.gbm.ranks
        src = self._source(route.ranks, ready, deepest)
        partners = self.topology.partners(src)
        bound = route.chosen.total_s if route.chosen is not None else float("inf")
        pricer = self.pricer
        terms, work = pricer.terms(query, max(expected)), pricer.work
        cascades, groups = pricer.limits.cascade_min_saved > 0, pricer.limits.cascade_groups
        prompt, cached = query.num_prompt_tokens, top * self.gbm.block_size  # for the floors
        src_step = None  # the source's step under way, read once (the first option that needs it)
        serving = {p.rank: p for p in route.prices or ()}  # each candidate's serve price, by rank
        out = []
        for r in takers:
            start = ready[r]
            if r not in partners:
                continue
            w = work(r)  # read once for its floor, its step and its price
            reads_once = cascades and (not groups or w.sharing(terms.head) > 0)  # the pricing's rule there
            if _least(w, serving.get(r), prompt, cached, terms.out, reads_once) >= bound:
                continue  # no copy, however fast, makes it the cheapest: skip its estimate
            in_flight = infos[r].in_flight
            if in_flight and any(h in in_flight for h in query.block_hashes[start:top]):
                continue
            if src_step is None:
                src_step = work(src).next_step if self.source_held else 0.0
            dst_step = w.next_step
            dst_held = dst_step if self.dest_held else 0.0
            steps = max(src_step, dst_held) + dst_step + dst_held  # prepare (both), execute, publish
            seconds = self.estimate_s(src, r, top - start) + steps
            price = pricer.price_work(terms, w, r, top, seconds, route.seed, top - start)
            if self.room(r) >= price.need:
                out.append(PullOption(price, src, start, top - start, seconds, steps))
        return out

    def _source(self, ranks: tuple[int, ...], ready: list[int], deepest: int) -> int:
        """The pull's source: of the ``ranks`` (ascending) matching ``deepest`` blocks, the one
        with the fewest requests in flight, the lowest on a tie (a loop: no key function calls)."""
        infos, src, least = self.gbm.ranks, -1, 0
        for r in ranks:
            if ready[r] == deepest:
                seqs = infos[r].in_flight_seqs
                if src < 0 or seqs < least:
                    src, least = r, seqs
        return src


def _least(work: RankWork, serve: RankPrice | None, prompt: int, cached: int, out: int, cascades: bool) -> float:
    """A floor under any pull's price to a rank of work ``work`` of the prompt's first ``cached``
    tokens: its serve price (``serve``) less everything the pulled blocks could save there, their
    prefill (its own, and that of the steps the sequences there share with it), every step of
    that prefill and, where the rank decodes shared prefixes once (``cascades``; with
    ``Limits.cascade_groups``, where a group there is the prompt's own, ``group_key``), what they take
    off each of its ``out - 1`` decode steps and of every step it shares (at most n a step): each
    key read alone becomes a pair of the cascade's prefix pass (and a lone member's of the group
    too, its steps and the request's, where it joins one)."""
    if serve is None:
        return float("-inf")
    c, missing, rest = work.c, serve.missing, prompt - cached  # c: what ``Pricer.prefill_s`` would read
    # ``prefill_seconds(c, missing, prompt - missing) - prefill_seconds(c, rest, cached)``, inlined:
    # every candidate below the pull's depth of every route that may leave its owner runs it (both
    # read the prompt's keys: those cancel).
    pairs = missing * (prompt - missing) + missing * (missing + 1) // 2 - rest * cached - rest * (rest + 1) // 2
    pulled = c.prefill_token * (missing - rest) + c.attention_pair * pairs
    floor = serve.total_s - (1 + work.n) * pulled - -(-missing // work.room) * work.step
    if cascades and missing > rest:
        saved = c.context_token - c.cascade_pair  # a read-once key's saving a step (a loss where negative)
        if saved > 0:  # ... and twice more where it joins a lone member (``Reservation.converted``)
            floor -= (3 + work.n) * (out - 1) * saved * (missing - rest)
    return floor


def shared_depth(chain: list[bytes], hashes: list[bytes], start: int, end: int) -> int:
    """How many leading blocks of ``chain`` equal ``hashes[start:end]``. Chained hashes name
    their whole prefix, so equality at one depth implies it at every smaller one: a bisection."""
    lo, hi = 0, min(len(chain), end - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] == hashes[start + mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def describe(o: PullOption) -> str:
    """One pull option, compactly: ``r1<-r0:12b=35`` (its price in milliseconds)."""
    return f"r{o.price.rank}<-r{o.src}:{o.blocks}b={o.price.total_s * 1e3:.0f}"
