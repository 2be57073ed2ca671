"""Block heat: per cached hash, the demand routed prompts showed for it, decayed over time.

A prompt containing a held block counts 1, and ``route_hit_weight`` more when its route used
the block; both halve every ``half_life_s``. Background placement copies the hottest chains.

A block is also ``branched`` once routed prompts have continued it two ways: two different
next blocks, or two prompts ending within the block after it (two questions about one
document). A prompt that continues past where an earlier one ended extends it, as a
conversation's next turn extends its history: a chain no prompt branched from is one
conversation's own, which a pull may move rather than copy.

Invariant (checked by the page table): stats exist only for hashes some rank holds ready; the
entry table forgets a hash's stats when its last ready copy goes.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from lmpool.protocol.base import BlockHash


class HashStats(msgspec.Struct, gc=False):
    """Demand for one cached block: how often routed prompts contained it, how often a route
    used it, and its heat. ``heat`` is kept scaled by ``2 ** (t / half_life)`` from its
    ``epoch``'s base time, so that a route adds to it without computing any decay.

    Untracked by the garbage collector (it holds numbers only): hundreds of thousands of these
    would otherwise make every full collection pause the control loop for tens of milliseconds.
    """

    accesses: int = 0
    route_hits: int = 0
    last_access: float = 0.0
    heat: float = 0.0
    epoch: int = 0
    child: bytes | None = None  # the next block of the latest prompt through it (``TAIL``: it ended there)
    branched: bool = False


TAIL = b""  # a prompt's continuation after its last complete block: a partial block, or nothing


class Heat:
    def __init__(self, half_life_s: float, route_hit_weight: float, clock: Callable[[], float]) -> None:
        self.half_life_s = half_life_s
        self.route_hit_weight = route_hit_weight
        self.clock = clock
        self.stats: dict[BlockHash, HashStats] = {}
        # Heat scaling: times are measured in half-lives from a base that moves (a new epoch)
        # before 2 ** x could overflow; an entry from an older epoch is rescaled when next met.
        self._bases = [clock()]

    def record_route(self, block_hashes: list[BlockHash], held: int, used: int) -> None:
        """The first ``held`` blocks are cached somewhere; the route used the first ``used``."""
        now = self.clock()
        stats = self.stats
        epoch, scale = self._scale(now)
        access, hit = scale, scale * (1.0 + self.route_hit_weight)
        last = len(block_hashes) - 1
        for i in range(held):
            h = block_hashes[i]
            s = stats.get(h)
            if s is None:
                s = stats[h] = HashStats(epoch=epoch)
            elif s.epoch != epoch:
                self._rebase(s, epoch)
            s.accesses += 1
            s.last_access = now
            child = block_hashes[i + 1] if i < last else TAIL
            known = s.child
            if known is None:
                s.child = child
            elif known != child or child == TAIL:
                if known != TAIL or child == TAIL:  # not a prompt extending one that ended here
                    s.branched = True
                s.child = child
            if i < used:
                s.route_hits += 1
                s.heat += hit
            else:
                s.heat += access

    def branched_depth(self, chain: list[BlockHash]) -> int:
        """How many leading blocks of ``chain`` lie at or above its deepest branched block (0: none is)."""
        stats = self.stats
        for i in range(len(chain) - 1, -1, -1):
            s = stats.get(chain[i])
            if s is not None and s.branched:
                return i + 1
        return 0

    def heat(self, block_hash: BlockHash) -> float:
        """The block's demand now: its accesses and route hits decayed to this instant (0 if never routed)."""
        s = self.stats.get(block_hash)
        if s is None:
            return 0.0
        epoch, scale = self._scale(self.clock())
        if s.epoch != epoch:
            self._rebase(s, epoch)
        return s.heat / scale

    def forget(self, block_hash: BlockHash) -> None:
        self.stats.pop(block_hash, None)

    def _scale(self, now: float) -> tuple[int, float]:
        """The current heat epoch and ``2 ** (half-lives since its base)``, starting a new epoch
        when that grows large (a rare event: every few hundred half-lives)."""
        bases = self._bases
        x = (now - bases[-1]) / self.half_life_s
        if x > 256:
            bases.append(now)
            x = 0.0
        return len(bases) - 1, 2.0 ** x

    def _rebase(self, s: HashStats, epoch: int) -> None:
        s.heat *= 2.0 ** ((self._bases[s.epoch] - self._bases[epoch]) / self.half_life_s)
        s.epoch = epoch
