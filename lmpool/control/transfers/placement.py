"""Background placement: copy hot cached chains from loaded ranks to idle partners.

Hotness comes from demand the control plane sees at ingress: every routed prompt
heats each block of its complete-block chain that some rank holds, a route that
used the block heats it more (``GlobalBlockManager.record_route``), and heat
decays with a half-life. ``HotChains`` remembers the most recently routed chains;
each pass (a control-plane task, never on the routing path) takes from each, newest
first, the deepest hot block with all its ancestors, and looks for a copy worth
making. A pass runs in slices of bounded time (``PlacementPass``), so a route never
waits behind a whole pass; its batches start when it ends, if they still pass the
gates that routes between slices can change (``stale``). A chain becomes a copy only
when every gate passes, in this order (each refusal is counted under its name in
``refused``):

- ``cooldown``: the admission gate refused the chain within ``cooldown_s`` and its heat has
  not doubled since (a prefix growing hotter is looked at again at once);
- ``no_source``: some rank holds the whole chain ready (all ancestors resident);
  the most loaded such rank is the source;
- ``no_partner``: the source has a live topology partner;
- ``destination_holds``: a partner lacks part of the chain (and no plan is bringing
  it); every such partner is a destination, least loaded first, each through the gates below;
- ``load_skew``: source load - destination load >= ``min_load_skew_s`` (loads in predicted seconds of
  work in flight, ``Pricer.load_s``);
- ``pair_busy``: no plan is open between the two ranks, nor a batch of this pass in
  the other direction (pair idleness);
- ``capacity``: the destination's room holds the copy: its free and reclaimable blocks, less
  reservations and blocks other plans bring. The destination's allocator makes room by
  evicting its coldest cached blocks that nobody references, never a block in use;
- ``batch_full``: the pair's batch this pass has room left (no cooldown: next pass);
- ``admission``: the saved prefill (one avoided cold prefill) beats the transfer cost.

A chain refused by every partner counts once, under its least loaded partner's gate. The
copy is the first ``max_blocks`` blocks the destination lacks, starting where its
own match ends, so the destination's chain stays contiguous from the root. ``max_blocks``
bounds one pass's speculation, not the copy: once its plan has landed the next pass carries
the next segment (while it is in flight, the destination counts as holding it). A chain copied only in
part would attract no routes: the owner still holds more of it. Copies for
one directed pair in one pass are coalesced into one plan (one payload) of at most
``batch_max_blocks`` blocks, each block once. When the plan completes, each chain
gets a placement lease (``leases``) that steers routes to the copy. A copy that reached its
leaf does not cool down: a chain still hot goes on to the next partner as soon as one lacks
it and passes the gates. A pass over every remembered chain runs periodically; driven by route
decisions, a pass over the chains routed since the last one runs within milliseconds of new
demand (``ControlPlane.react``); ``tick`` runs a whole pass at once.

Invariants: a pass starts at most one plan per directed pair and none on a pair with
an open plan (nor in both directions); a copy never needs more than the destination's room;
a batch holds each hash once, parents before children, and never more than
``batch_max_blocks``; every chain in a batch passed every gate.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.route import Route, RouteStage
from lmpool.control.topology import Topology
from lmpool.control.transfers.admission import AdmissionDecision, AdmissionGate
from lmpool.control.transfers.coordinator import TransferCoordinator
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.base import BlockHash


class HotChains:
    """The most recently routed chains (the part some rank held), newest last, keyed by leaf;
    those routed since the last pass began are fresh."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # Insertion-ordered (oldest first): a chain routed again moves to the end. A chain's leaf is its key.
        self._chains: dict[BlockHash, list[BlockHash]] = {}
        self._fresh: dict[BlockHash, None] = {}  # leaves routed since the last pass began, oldest first

    def __len__(self) -> int:
        return len(self._chains)

    def observe(self, block_hashes: list[BlockHash], held: int) -> None:
        """A routed prompt whose first ``held`` blocks some rank holds."""
        if held <= 0:
            return
        leaf = block_hashes[held - 1]
        self._chains.pop(leaf, None)
        self._chains[leaf] = block_hashes[:held]
        self._fresh.pop(leaf, None)
        self._fresh[leaf] = None
        if len(self._chains) > self.capacity:
            del self._chains[next(iter(self._chains))]
        if len(self._fresh) > self.capacity:
            del self._fresh[next(iter(self._fresh))]

    def newest_first(self, fresh_only: bool = False) -> list[list[BlockHash]]:
        """The remembered chains, newest first, or only the fresh ones: a pass's own list, which
        routes observed during the pass leave alone. None of them is fresh after."""
        if fresh_only:
            chains = self._chains
            out = [chains[leaf] for leaf in reversed(self._fresh) if leaf in chains]
        else:
            out = list(self._chains.values())[::-1]
        self._fresh.clear()
        return out

    def forget(self, chain: list[BlockHash]) -> None:
        """Forget ``chain`` (a cold one) unless a newer route has put another chain under its leaf."""
        if self._chains.get(chain[-1]) is chain:
            del self._chains[chain[-1]]


def hot_depth(chain: list[BlockHash], heat: Callable[[BlockHash], float], threshold: float) -> int:
    """How many blocks of ``chain`` lead to its deepest block at least ``threshold`` hot (0: none).
    Every routed prompt heats a prefix of its chain, so heat never grows with depth and the
    deepest hot block is found by bisection (a handful of lookups, not one per block)."""
    lo, hi = 0, len(chain)  # chain[:lo] is hot; chain[hi:] is not
    while lo < hi:
        mid = (lo + hi) // 2
        if heat(chain[mid]) >= threshold:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass
class CopyBatch:
    """One plan: chain segments copied over one directed pair, coalesced."""

    src: int
    dst: int
    hashes: list[BlockHash] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    parents: list[BlockHash] = field(default_factory=list)
    leases: list[tuple[BlockHash, int]] = field(default_factory=list)  # (leaf, depth) per chain copied

    def add(self, chain: list[BlockHash], start: int, end: int, generations: list[int]) -> None:
        held = set(self.hashes)
        for i in range(start, end):
            if chain[i] not in held:
                self.hashes.append(chain[i])
                self.generations.append(generations[i - start])
                self.parents.append(chain[i - 1] if i else ROOT_HASH)
        self.leases.append((chain[end - 1], end))


class ObserveChains(RouteStage):
    """The route stage that gives placement its candidates: every routed prompt's held chain."""

    def __init__(self, chains: HotChains) -> None:
        self.chains = chains

    def record(self, route: Route) -> None:
        self.chains.observe(route.query.block_hashes, max(route.ready))


class BackgroundPlacement:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        topology: Topology,
        load_s: Callable[[int], float],
        coordinator: TransferCoordinator,
        gate: AdmissionGate,
        prefill_s_per_token: Callable[[int], float | None],
        chains: HotChains,
        *,
        hot_threshold: float,
        min_load_skew_s: float,
        cooldown_s: float,
        max_blocks: int,
        batch_max_blocks: int,
    ) -> None:
        self.gbm = gbm
        self.topology = topology
        self.load_s = load_s  # a rank's work in flight, in predicted seconds
        self.coordinator = coordinator
        self.gate = gate
        self.prefill_s_per_token = prefill_s_per_token
        self.hot_threshold = hot_threshold
        self.min_load_skew_s = min_load_skew_s
        self.cooldown_s = cooldown_s
        self.max_blocks = max_blocks
        self.batch_max_blocks = batch_max_blocks
        self.chains = chains
        # Chain leaf -> (when it may be looked at again, its heat when the gate refused it).
        self.cooling: dict[BlockHash, tuple[float, float]] = {}
        self.refused: Counter[str] = Counter()
        self.decisions: list[AdmissionDecision] = []  # the latest pass's gate decisions
        self.ticks = 0

    def tick(self) -> list[CopyBatch]:
        """A whole pass at once: the copies to start now (module docstring)."""
        placement_pass = self.start_pass()
        while not placement_pass.run(None):
            pass
        return placement_pass.copies()

    def start_pass(self, fresh_only: bool = False) -> PlacementPass:
        """A pass over the remembered chains, newest first, to run in slices (``PlacementPass``);
        ``fresh_only``: over those routed since the last pass began (a route's reaction)."""
        self.ticks += 1
        self.decisions = []
        now = self.gbm.clock()
        cooling = self.cooling  # ordered by expiry: each entry is (re)inserted at the end
        while cooling:
            leaf = next(iter(cooling))
            if cooling[leaf][0] > now:
                break
            del cooling[leaf]
        return PlacementPass(self, now, self.chains.newest_first(fresh_only))

    def consider(self, chain: list[BlockHash], now: float, batches: dict, taken: Counter) -> Generator[None, None, str]:
        """Put one hot chain's copies into batches, one step per partner tried (a pass's slice may
        end between two); the generator returns the refusing gate's name, or ""."""
        gbm, topology = self.gbm, self.topology
        leaf = chain[-1]
        cooling = self.cooling.get(leaf)
        if cooling is not None and gbm.heat(leaf) < 2 * cooling[1]:
            return "cooldown"
        # One walk gives every live rank's ready match: a rank holds the whole chain (all its
        # ancestors resident) exactly when its match is the chain's length.
        matched = gbm.prefix_match(chain)
        ranks = [r for r in range(gbm.world_size) if matched[r] == len(chain)]
        if not ranks:
            return "no_source"
        src = max(ranks, key=lambda r: (self.load_s(r), -r))
        partners = [r for r in topology.partners(src) if gbm.alive_mask >> r & 1]
        if not partners:
            return "no_partner"
        lacking = []
        for dst in partners:
            start = matched[dst]
            if start == len(chain):
                continue
            end = min(len(chain), start + self.max_blocks)
            in_flight = gbm.ranks[dst].in_flight
            if not in_flight or not any(chain[i] in in_flight for i in range(start, end)):
                lacking.append((dst, start, end))
        if not lacking:
            return "destination_holds"
        lacking.sort(key=lambda c: (self.load_s(c[0]), c[0]))
        reasons = []
        for dst, start, end in lacking:
            reasons.append(self._copy(chain, src, dst, start, end, batches, taken))
            yield
        if "" in reasons:
            self.cooling.pop(leaf, None)
            return ""
        if "admission" in reasons:
            self.cooling.pop(leaf, None)  # to the end: the dict stays ordered by expiry
            self.cooling[leaf] = (now + self.cooldown_s, gbm.heat(leaf))
        return reasons[0]

    def stale(self, batch: CopyBatch, granted: int) -> str:
        """The gate a batch no longer passes after routes and plans changed the pool during its
        pass, or "": both ranks alive, no plan open on the pair, the room still there beside the
        ``granted`` blocks that batches kept before it take on the destination."""
        gbm, coordinator = self.gbm, self.coordinator
        if not gbm.alive_mask >> batch.src & 1:
            return "no_source"
        if not gbm.alive_mask >> batch.dst & 1:
            return "no_partner"
        if coordinator.busy(batch.src, batch.dst):
            return "pair_busy"
        if coordinator.room(batch.dst) - granted < len(batch.hashes):
            return "capacity"
        return ""

    def _copy(self, chain: list[BlockHash], src: int, dst: int, start: int, end: int, batches: dict,
              taken: Counter) -> str:
        """Add blocks ``start:end`` of ``chain`` to the (src, dst) batch if every gate passes."""
        gbm = self.gbm
        if self.load_s(src) - self.load_s(dst) < self.min_load_skew_s:
            return "load_skew"
        if self.coordinator.busy(src, dst) or (dst, src) in batches:
            return "pair_busy"
        # src held blocks start:end ready when the pass chose it, but a pass runs in slices and the
        # workers' reports between them may have taken some away since.
        found = [gbm.generation(src, chain[i]) for i in range(start, end)]
        generations = [g for g in found if g is not None]
        if len(generations) < len(found):
            return "no_source"
        batch = batches.get((src, dst))
        if batch is None:
            new = end - start
        else:
            held = set(batch.hashes)
            new = sum(1 for i in range(start, end) if chain[i] not in held)
        if self.coordinator.room(dst) - taken[dst] < new:
            return "capacity"
        if batch is not None and len(batch.hashes) + new > self.batch_max_blocks:
            return "batch_full"  # not refused on its merits: no cooldown, look again next tick
        if new:
            decision = self.gate.background(src, dst, new, self.prefill_s_per_token(dst))
            self.decisions.append(decision)
            if not decision.admitted:
                return "admission"
        if batch is None:
            batch = batches[(src, dst)] = CopyBatch(src, dst)
        batch.add(chain, start, end, generations)
        taken[dst] += new
        return ""


class PlacementPass:
    """One placement pass, run in slices so that the control loop routes between them: ``run``
    takes steps (a chain taken up, or one partner tried for it) until its budget is spent; once
    every chain was considered, ``next_copy`` gives the batches one by one, for the caller to
    check against the gates that routes between slices can change (``stale``: both ranks
    alive, the pair idle, the destination's room) as it starts each; ``copies()`` checks all
    at once (a whole pass, ``BackgroundPlacement.tick``)."""

    def __init__(self, placement: BackgroundPlacement, now: float, chains: list[list[BlockHash]]) -> None:
        self.placement = placement
        self.now = now
        self._chains = chains
        self._next = 0
        self._seen: set[BlockHash] = set()  # deepest hot blocks considered: each hot prefix once
        self.batches: dict[tuple[int, int], CopyBatch] = {}
        self.taken: Counter[int] = Counter()  # blocks this pass's batches take on each destination
        self._order: list[CopyBatch] | None = None  # the batches not yet given out, last first
        self._step: Generator[None, None, str] | None = None  # the chain under consideration

    def run(self, budget_s: float | None) -> bool:
        """Consider chains for ``budget_s`` seconds at most past one step (None: no limit); True
        once every chain was considered."""
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while self._advance():
            if deadline is not None and time.perf_counter() >= deadline:
                return False
        return True

    def _advance(self) -> bool:
        """One step: a partner tried for the chain under consideration, else the next chain
        taken up; False once no chain is left."""
        if self._step is None:
            if self._next >= len(self._chains):
                return False
            self._step = self._take(self._chains[self._next])
            self._next += 1
            if self._step is None:
                return True
        try:
            next(self._step)
        except StopIteration as done:
            self._step = None
            if done.value:
                self.placement.refused[done.value] += 1
        return True

    def _take(self, chain: list[BlockHash]) -> Generator[None, None, str] | None:
        """The consideration of ``chain``'s hot prefix, or None: not hot, or its prefix seen."""
        placement = self.placement
        gbm = placement.gbm
        depth = hot_depth(chain, gbm.heat, placement.hot_threshold)
        if not depth:
            if gbm.heat(chain[0]) == 0.0:
                placement.chains.forget(chain)  # no rank holds even its root any more
            return None
        if chain[depth - 1] in self._seen:
            return None
        self._seen.add(chain[depth - 1])
        return placement.consider(chain[:depth], self.now, self.batches, self.taken)

    def next_copy(self) -> CopyBatch | None:
        """The pass's batches one at a time, in order, once its chains are done (None: no more);
        the caller checks each against the gates as they are when it starts it (``stale``)."""
        if self._order is None:
            self._order = [b for b in reversed(self.batches.values()) if b.hashes]  # popped from the end
        return self._order.pop() if self._order else None

    def copies(self) -> list[CopyBatch]:
        """Every batch that would start now, each checked against the gates beside those before it."""
        placement = self.placement
        out = []
        granted: Counter[int] = Counter()  # blocks the batches kept so far take on each destination
        for batch in self.batches.values():
            reason = placement.stale(batch, granted[batch.dst])
            if reason:
                placement.refused[reason] += 1
            elif batch.hashes:
                granted[batch.dst] += len(batch.hashes)
                out.append(batch)
        return out
