"""Background placement: copy hot cached chains from loaded ranks to idle partners.

Hotness comes from demand the control plane sees at ingress: every routed prompt
heats each block of its complete-block chain that some rank holds, a route that
used the block heats it more (``GlobalBlockManager.record_route``), and heat
decays with a half-life. ``HotChains`` remembers the most recently routed chains;
each ``tick`` (a periodic control-plane task, never on the routing path) takes
from each the deepest hot block with all its ancestors, and looks for a copy
worth making. A chain becomes a copy only when every gate passes, in this order
(each refusal is counted under its name in ``refused``):

- ``cooldown``: the admission gate refused the chain within ``cooldown_s`` and its heat has
  not doubled since (a prefix growing hotter is looked at again at once);
- ``no_source``: some rank holds the whole chain ready (all ancestors resident);
  the most loaded such rank is the source;
- ``no_partner``: the source has a live topology partner;
- ``destination_holds``: a partner lacks part of the chain (and no plan is bringing
  it); every such partner is a destination, least loaded first, each through the gates below;
- ``load_skew``: source load - destination load >= ``min_load_skew_tokens``;
- ``pair_busy``: no plan is open between the two ranks, nor a batch of this tick in
  the other direction (pair idleness);
- ``capacity``: the destination's room holds the copy: its free and reclaimable blocks, less
  reservations and blocks other plans bring. The destination's allocator makes room by
  evicting its coldest cached blocks that nobody references, never a block in use;
- ``batch_full``: the pair's batch this tick has room left (no cooldown: next tick);
- ``admission``: the saved prefill (one avoided cold prefill) beats the transfer cost.

A chain refused by every partner counts once, under its least loaded partner's gate. The
copy is the first ``max_blocks`` blocks the destination lacks, starting where its
own match ends, so the destination's chain stays contiguous from the root. ``max_blocks``
bounds one tick's speculation, not the copy: once its plan has landed the next tick carries
the next segment (while it is in flight, the destination counts as holding it). A chain copied only in
part would attract no routes: the owner still holds more of it. Copies for
one directed pair in one tick are coalesced into one plan (one payload) of at most
``batch_max_blocks`` blocks, each block once. When the plan completes, each chain
gets a placement lease (``leases``) that steers routes to the copy. A copy that reached its
leaf does not cool down: a chain still hot goes on to the next partner as soon as one lacks
it and passes the gates. ``tick`` runs periodically and, driven by route decisions, within
milliseconds of new demand (``ControlPlane.react``).

Invariants: a tick starts at most one plan per directed pair and none on a pair with
an open plan (nor in both directions); a copy never needs more than the destination's room;
a batch holds each hash once, parents before children, and never more than
``batch_max_blocks``; every chain in a batch passed every gate.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.routing.router import Router
from lmpool.engine.hashing import ROOT_HASH
from lmpool.control.transfers.admission import AdmissionDecision, AdmissionGate
from lmpool.control.transfers.coordinator import TransferCoordinator


class HotChains:
    """The most recently routed chains (the part some rank held), newest last, keyed by leaf."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._chains: OrderedDict[int, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chains)

    def observe(self, block_hashes: list[int], held: int) -> None:
        """A routed prompt whose first ``held`` blocks some rank holds."""
        if held <= 0:
            return
        leaf = block_hashes[held - 1]
        self._chains.pop(leaf, None)
        self._chains[leaf] = block_hashes[:held]
        if len(self._chains) > self.capacity:
            self._chains.popitem(last=False)

    def hot(self, heat: Callable[[int], float], threshold: float) -> list[list[int]]:
        """Per remembered chain, newest first, its prefix up to the deepest block at least
        ``threshold`` hot; each such prefix once. Chains with no hot block are forgotten."""
        found: dict[int, list[int]] = {}
        cold = []
        for leaf, chain in reversed(self._chains.items()):
            depth = len(chain)
            while depth and heat(chain[depth - 1]) < threshold:
                depth -= 1
            if not depth:
                if heat(chain[0]) == 0.0:
                    cold.append(leaf)  # no rank holds even its root any more
                continue
            found.setdefault(chain[depth - 1], chain[:depth])
        for leaf in cold:
            del self._chains[leaf]
        return list(found.values())


@dataclass
class CopyBatch:
    """One plan: chain segments copied over one directed pair, coalesced."""

    src: int
    dst: int
    hashes: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    leases: list[tuple[int, int]] = field(default_factory=list)  # (leaf, depth) per chain copied

    def add(self, chain: list[int], start: int, end: int, generations: list[int]) -> None:
        held = set(self.hashes)
        for i in range(start, end):
            if chain[i] not in held:
                self.hashes.append(chain[i])
                self.generations.append(generations[i - start])
                self.parents.append(chain[i - 1] if i else ROOT_HASH)
        self.leases.append((chain[end - 1], end))


class BackgroundPlacement:
    def __init__(
        self,
        gbm: GlobalBlockManager,
        scheduler: Router,
        coordinator: TransferCoordinator,
        gate: AdmissionGate,
        prefill_s_per_token: Callable[[int], float | None],
        *,
        hot_threshold: float,
        min_load_skew_tokens: float,
        cooldown_s: float,
        max_blocks: int,
        batch_max_blocks: int,
        recent_chains: int = 256,
    ) -> None:
        self.gbm = gbm
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.gate = gate
        self.prefill_s_per_token = prefill_s_per_token
        self.hot_threshold = hot_threshold
        self.min_load_skew_tokens = min_load_skew_tokens
        self.cooldown_s = cooldown_s
        self.max_blocks = max_blocks
        self.batch_max_blocks = batch_max_blocks
        self.chains = HotChains(recent_chains)
        # Chain leaf -> (when it may be looked at again, its heat when the gate refused it).
        self.cooling: dict[int, tuple[float, float]] = {}
        self.refused: Counter[str] = Counter()
        self.decisions: list[AdmissionDecision] = []  # the latest tick's gate decisions
        self.ticks = 0

    def tick(self) -> list[CopyBatch]:
        """The copies to start now, at most one batch per directed pair (module docstring)."""
        self.ticks += 1
        self.decisions = []
        now = self.gbm.clock()
        for leaf in [leaf for leaf, (until, _) in self.cooling.items() if until <= now]:
            del self.cooling[leaf]
        batches: dict[tuple[int, int], CopyBatch] = {}
        taken: Counter[int] = Counter()  # blocks this tick's batches take on each destination
        for chain in self.chains.hot(self.gbm.heat, self.hot_threshold):
            reason = self._consider(chain, now, batches, taken)
            if reason:
                self.refused[reason] += 1
        return [b for b in batches.values() if b.hashes]

    def _consider(self, chain: list[int], now: float, batches: dict, taken: Counter) -> str:
        """Put one hot chain's copies into batches; return the refusing gate's name, or ""."""
        gbm, topology = self.gbm, self.scheduler.topology
        leaf = chain[-1]
        cooling = self.cooling.get(leaf)
        if cooling is not None and gbm.heat(leaf) < 2 * cooling[1]:
            return "cooldown"
        holders = gbm.alive_mask
        for h in chain:
            holders &= gbm.ready_ranks(h)
        if not holders:
            return "no_source"
        ranks = [r for r in range(gbm.world_size) if holders >> r & 1]
        src = max(ranks, key=lambda r: (self.scheduler.rank_load(r), -r))
        partners = [r for r in topology.partners(src) if gbm.alive_mask >> r & 1]
        if not partners:
            return "no_partner"
        lacking = []
        for dst in partners:
            start = gbm.prefix_match(chain, 1 << dst)[dst]
            end = min(len(chain), start + self.max_blocks)
            in_flight = gbm.ranks[dst].in_flight
            if start < len(chain) and not any(chain[i] in in_flight for i in range(start, end)):
                lacking.append((dst, start, end))
        if not lacking:
            return "destination_holds"
        lacking.sort(key=lambda c: (self.scheduler.rank_load(c[0]), c[0]))
        reasons = [self._copy(chain, src, dst, start, end, batches, taken) for dst, start, end in lacking]
        if "" in reasons:
            self.cooling.pop(leaf, None)
            return ""
        if "admission" in reasons:
            self.cooling[leaf] = (now + self.cooldown_s, gbm.heat(leaf))
        return reasons[0]

    def _copy(self, chain: list[int], src: int, dst: int, start: int, end: int, batches: dict,
              taken: Counter) -> str:
        """Add blocks ``start:end`` of ``chain`` to the (src, dst) batch if every gate passes."""
        gbm = self.gbm
        if self.scheduler.rank_load(src) - self.scheduler.rank_load(dst) < self.min_load_skew_tokens:
            return "load_skew"
        if self.coordinator.busy(src, dst) or (dst, src) in batches:
            return "pair_busy"
        batch = batches.get((src, dst))
        held = set(batch.hashes) if batch is not None else set()
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
        generations = [gbm.generation(src, chain[i]) for i in range(start, end)]
        if batch is None:
            batch = batches[(src, dst)] = CopyBatch(src, dst)
        batch.add(chain, start, end, generations)
        taken[dst] += new
        return ""
