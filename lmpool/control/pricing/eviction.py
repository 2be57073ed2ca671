"""How often a rank's evictions are regretted: the measured reuse that prices evicting a block.

Every block a rank reports removed is remembered for a while (a ghost, per rank, at most
``capacity`` of them, the oldest forgotten first). When a routed prompt's first block that no
rank holds (nor will, pending) is a ghost of a rank, that rank's eviction is regretted: a
later request wanted it. A rank's reuse is its regrets over its evictions, both decayed
(``half_life`` evictions), with one regret in two evictions as the prior:

    reuse_r = (regrets_r + 1) / (evictions_r + 2)

Routing prices evicting ``k`` blocks on r as ``k * reuse_r`` blocks recomputed later.

Invariants: a ghost is regretted at most once; every rank's ghosts stay within ``capacity``;
0 < reuse < 1.
"""

from __future__ import annotations

from collections import OrderedDict

from lmpool.protocol.base import BlockHash

HALF_LIFE = 4096  # evictions


class EvictionMemory:
    def __init__(self, world_size: int, capacity: int = 1 << 16, half_life: float = HALF_LIFE) -> None:
        if world_size < 1 or capacity < 1 or not half_life > 0:
            raise ValueError(f"need world_size, capacity >= 1 and half_life > 0, got {world_size}, {capacity}, "
                             f"{half_life}")
        self.capacity = capacity
        self.decay = 0.5 ** (1.0 / half_life)
        self._ghosts: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(world_size)]
        self.evictions = [0.0] * world_size
        self.regrets = [0.0] * world_size

    def removed(self, rank: int, block_hash: BlockHash) -> None:
        """``rank`` reported ``block_hash`` removed from its cache."""
        ghosts = self._ghosts[rank]
        ghosts.pop(block_hash, None)
        ghosts[block_hash] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)
        self.evictions[rank] = self.evictions[rank] * self.decay + 1.0
        self.regrets[rank] *= self.decay

    def wanted(self, block_hash: BlockHash) -> None:
        """A routed prompt needs ``block_hash`` and no rank holds it: each rank that evicted it regrets it."""
        for rank, ghosts in enumerate(self._ghosts):
            if block_hash in ghosts:
                del ghosts[block_hash]
                self.regrets[rank] += 1.0

    def reuse(self, rank: int) -> float:
        return (self.regrets[rank] + 1.0) / (self.evictions[rank] + 2.0)

    def drop_rank(self, rank: int) -> None:
        """The rank restarted or died: its cache, and what it evicted from it, are gone."""
        self._ghosts[rank].clear()
