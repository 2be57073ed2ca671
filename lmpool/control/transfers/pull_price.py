"""Route-time prices of a request's options, per candidate rank, in token-equivalents.

For rank r, with the LMPool policy's projection ``RankCost`` c (``CostModel.project``:
c.load = queued prefill + weighted decode work, c.missing = prompt tokens to compute, c.cost =
load + missing + reclaim) and ``contention_r`` (below):

    serve_r  = c.cost + contention_r                         # its cache; recompute what it lacks
    pull_r   = max(c.load, copy_r) + c.missing - k * B + reclaim_r + contention_r

where a pull brings the k blocks of the prompt that the best holder s has ready and r lacks,
``copy_r`` is the cost model's estimate for k blocks s -> r (or what is left of an open pull
the request would share) in prefill-token equivalents of r, and the copy runs while r's queue
drains, hence the max. Decode contention: the request shares each of its decode steps with
the sequences on r (running, waiting, routed and not yet admitted), and each of them slows
by it as it slows by them:

    contention_r = decode_contention_weight * batch_r * max_tokens

so spreading requests that share a cached prefix pays once the owner's batch costs more than
a copy, whether the ranks share a GPU or not (the copy's price is the pair's own).

A pull is priced only where it can run: r and s are topology partners, r has no pending prefix
(its own queued prefill would produce those blocks), none of the k blocks is in flight to r,
and r has room for the request's blocks (free + reclaimable, less reservations and incoming
plans). Invariants: every option is for a candidate rank; a pull brings k >= 1 blocks, all
ready on its source, never past the prompt's last usable block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.cost import RankCost
from lmpool.control.topology import Topology
from lmpool.protocol import RouteQuery


class Option(NamedTuple):
    kind: str  # "serve" (the rank's own cache) or "pull" (copy the prefix there first)
    rank: int
    cost: float
    src: int = -1
    blocks: int = 0  # blocks the pull brings
    copy_tokens: float = 0.0  # the copy's wait, in prefill-token equivalents
    shared: int = 0  # the open pull this request would share (0: a new plan)
    copy_s: float = 0.0  # the copy's estimated seconds (a new plan)


class OpenPullView(NamedTuple):
    """What pricing needs of an open pull: its plan, first hash, blocks and seconds left."""

    plan_id: int
    hashes: list[int]
    seconds_left: float


class PullPricer:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        topology: Topology,
        estimate_s: Callable[[int, int, int], float],
        prefill_s_per_token: Callable[[int], float],
        room: Callable[[int], int],
        *,
        contention_weight: float,
    ) -> None:
        self.gbm = gbm
        self.topology = topology
        self.estimate_s = estimate_s
        self.prefill_s_per_token = prefill_s_per_token
        self.room = room
        self.contention_weight = contention_weight

    def serve(self, query: RouteQuery, costs: list[RankCost]) -> list[Option]:
        """Serving on each candidate: its projected cost plus its decode contention."""
        per_sequence = self.contention_weight * query.max_tokens
        infos = self.gbm.ranks
        out = []
        for c in costs:
            info = infos[c.rank]
            load = info.load
            batch = load.num_running + load.num_waiting + info.num_reservations
            out.append(Option("serve", c.rank, c.cost + per_sequence * batch))
        return out

    def options(self, query: RouteQuery, costs: list[RankCost], lengths: list[int], expected: list[int],
                open_pull: Callable[[int, int], OpenPullView | None], bound: Callable[[list[Option]], float],
                ) -> list[Option]:
        """Serve on each candidate, then pull to each where one can run and could cost less than
        ``bound(serve options)`` (a pull that cannot win is not priced: it would cost the route
        a copy estimate for nothing). ``open_pull(dst, first_hash)`` names a pull already
        bringing that chain to ``dst``."""
        serve = self.serve(query, costs)
        if not costs:
            return serve
        usable = min(len(query.block_hashes), max(0, (query.num_prompt_tokens - 1) // self.gbm.block_size))
        src = max(costs, key=lambda c: (lengths[c.rank], -c.load, -c.rank)).rank
        top = min(lengths[src], usable)
        limit = bound(serve)
        block_size = self.gbm.block_size
        out = list(serve)
        for c, o in zip(costs, serve):
            if c.matched >= top or expected[c.rank] != lengths[c.rank]:
                continue
            # The copy takes no time at best: the least this pull can cost.
            if o.cost - (top - c.matched) * block_size >= limit:
                continue
            pull = self._pull(query, c, src, top, o.cost - c.cost, open_pull)
            if pull is not None:
                out.append(pull)
        return out

    def _pull(self, query: RouteQuery, c: RankCost, src: int, top: int, contention: float,
              open_pull: Callable[[int, int], OpenPullView | None]) -> Option | None:
        hashes, block_size = query.block_hashes, self.gbm.block_size
        per_token = self.prefill_s_per_token(c.rank)
        extra = c.cost - c.load - c.missing  # the reclaim term
        shared = open_pull(c.rank, hashes[c.matched])
        if shared is not None:
            k = shared_depth(shared.hashes, hashes, c.matched, top)
            wait = shared.seconds_left / per_token
            return Option("pull", c.rank, max(c.load, wait) + c.missing - k * block_size + extra + contention,
                          -1, k, wait, shared.plan_id)
        if c.rank not in self.topology.partners(src) or self.room(c.rank) < c.need:
            return None
        k = top - c.matched
        in_flight = self.gbm.ranks[c.rank].in_flight
        if in_flight and any(h in in_flight for h in hashes[c.matched:top]):
            return None
        seconds = self.estimate_s(src, c.rank, k)
        wait = seconds / per_token
        return Option("pull", c.rank, max(c.load, wait) + c.missing - k * block_size + extra + contention,
                      src, k, wait, 0, seconds)


def shared_depth(chain: list[int], hashes: list[int], start: int, end: int) -> int:
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


def describe(options: list[Option]) -> str:
    """The priced alternatives, compactly: ``serve r0=812 r1=40 pull r1<-r0:12b=35``."""
    serve = " ".join(f"r{o.rank}={int(o.cost)}" for o in options if o.kind == "serve")
    pulls = " ".join(
        f"r{o.rank}<-{'shared' if o.shared else f'r{o.src}'}:{o.blocks}b={int(o.cost)}"
        for o in options if o.kind == "pull"
    )
    return f"serve {serve}" + (f" pull {pulls}" if pulls else "")
