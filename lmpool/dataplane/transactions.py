"""One worker's side of transactional KV transfers, keyed by plan id (docs/ARCHITECTURE.md,
"Plans"): the source pins, the destination reserves, receives and publishes; either side
aborts from any phase before its last.

Invariants:
- every block a plan holds is referenced exactly once by it (``held_blocks``), a source's
  cached ancestors included, so the BlockManager's ref counts account for transfers;
- reserved destination blocks are uncached until publish;
- abort releases everything the plan holds and never touches the source's cached copy; a
  move's finalize frees only the unreferenced suffix past its first ``keep`` blocks;
- a plan whose control plane falls silent for ``lease_s`` is aborted here (``expire``);
- every phase message is idempotent; one for a plan that ended changes nothing; one that
  needs a phase this side has not reached raises ``StalePlanError``.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.base import BlockHash

ENDED_PLANS_KEPT = 4096  # outcomes remembered for duplicate messages


class StalePlanError(ValueError):
    """A phase message that does not fit the plan's state on this worker."""


class Role(enum.Enum):
    SOURCE = "source"
    DEST = "dest"


class Phase(enum.Enum):
    PREPARED = "prepared"
    EXECUTED = "executed"  # bytes sent (source) or received (destination)
    PUBLISHED = "published"  # destination: blocks visible; the plan has ended here
    FINALIZED = "finalized"  # source: pins released (and a move's suffix freed); ended
    ABORTED = "aborted"


ENDED = (Phase.PUBLISHED, Phase.FINALIZED, Phase.ABORTED)


@dataclass
class LocalPlan:
    plan_id: int
    role: Role
    phase: Phase
    block_ids: list[int]  # the blocks whose bytes move
    pinned: list[int]  # every block the plan references here: its own, then ancestors it pins
    token_ids: list[list[int]] = field(default_factory=list)  # source: each block's tokens
    touched: float = 0.0  # when the last phase message for it arrived


class TransferParticipant:
    def __init__(
        self, block_manager: BlockManager, lease_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bm = block_manager
        self.lease_s = lease_s
        self.clock = clock
        self.plans: dict[int, LocalPlan] = {}
        self.ended: OrderedDict[int, Phase] = OrderedDict()

    # ---- phases -------------------------------------------------------------------

    def prepare_source(self, plan_id: int, block_hashes: list[BlockHash], generations: list[int]) -> LocalPlan:
        """Pin the chain's blocks; raises ``StaleBlockError`` if any is gone or reused."""
        plan = self._existing(plan_id, Role.SOURCE)
        if plan is not None:
            return plan
        ids, pinned = self.bm.pin_cached(block_hashes, generations)
        tokens = [list(self.bm.blocks[b].token_ids) for b in ids]
        return self._open(LocalPlan(plan_id, Role.SOURCE, Phase.PREPARED, ids, pinned, tokens))

    def prepare_dest(self, plan_id: int, num_blocks: int, anchor: BlockHash = ROOT_HASH,
                     anchor_generation: int = 0) -> LocalPlan:
        """Reserve ``num_blocks`` fresh, invisible blocks; raises ``RuntimeError`` if they do not
        fit. An ``anchor`` (a cached block the received chain continues) is pinned first, with its
        ancestors, so that the allocation cannot evict it; ``StaleBlockError`` if it is gone."""
        plan = self._existing(plan_id, Role.DEST)
        if plan is not None:
            return plan
        anchored = self.bm.pin_cached([anchor], [anchor_generation])[1] if anchor else []
        try:
            ids = self.bm.allocate_blocks(num_blocks)
        except RuntimeError:
            for block_id in anchored:
                self.bm.release(block_id)
            raise
        return self._open(LocalPlan(plan_id, Role.DEST, Phase.PREPARED, ids, ids + anchored))

    def executed(self, plan_id: int) -> None:
        """The bytes have moved (sent from the source, or unpacked at the destination)."""
        plan = self._active(plan_id)
        if plan is not None and plan.phase is Phase.PREPARED:
            plan.phase = Phase.EXECUTED

    def expire(self) -> list[int]:
        """Abort the plans that heard nothing for ``lease_s``; return their ids."""
        stale = [p.plan_id for p in self.plans.values() if self.clock() - p.touched > self.lease_s]
        for plan_id in stale:
            self.abort(plan_id)
        return stale

    def publish(
        self, plan_id: int, block_hashes: list[BlockHash], parent_hashes: list[BlockHash], token_ids: list[list[int]]
    ) -> None:
        """Destination: the received blocks join the prefix cache (and the page table, by delta)."""
        plan = self._active(plan_id)
        if plan is None:
            return
        if plan.role is not Role.DEST or plan.phase is not Phase.EXECUTED:
            raise StalePlanError(f"plan {plan_id}: publish needs a destination that received, not {plan.phase.value}")
        if len(block_hashes) != len(plan.block_ids):
            raise StalePlanError(f"plan {plan_id}: {len(block_hashes)} hashes for {len(plan.block_ids)} blocks")
        self.bm.publish_received(plan.block_ids, block_hashes, parent_hashes, token_ids)
        for block_id in plan.pinned[len(plan.block_ids):]:  # the anchor: the chain is whole now
            self.bm.release(block_id)
        self._close(plan, Phase.PUBLISHED)

    def finalize(self, plan_id: int, move: bool, keep: int = 0) -> list[int]:
        """Source, after the destination published: drop the pins; a move also frees the
        chain's unreferenced suffix, never its first ``keep`` blocks (a partial move copied
        them along only as the moved blocks' ancestors). Returns the freed block ids."""
        plan = self._active(plan_id)
        if plan is None:
            return []
        if plan.role is not Role.SOURCE or plan.phase is not Phase.EXECUTED:
            raise StalePlanError(f"plan {plan_id}: finalize needs a source that sent, not {plan.phase.value}")
        for block_id in plan.pinned:
            self.bm.release(block_id)
        freed = self.bm.drop_unreferenced_suffix(plan.block_ids[max(0, keep):]) if move else []
        self._close(plan, Phase.FINALIZED)
        return freed

    def abort(self, plan_id: int) -> None:
        """Release whatever the plan holds here; the source's cached blocks stay cached."""
        plan = self.plans.get(plan_id)
        if plan is None:
            if plan_id not in self.ended:
                self._remember(plan_id, Phase.ABORTED)  # a late prepare must not resurrect it
            return
        for block_id in plan.pinned:
            self.bm.release(block_id)
        self._close(plan, Phase.ABORTED)

    # ---- bookkeeping ----------------------------------------------------------------

    def held_blocks(self) -> list[list[int]]:
        """Blocks referenced by open plans (for the BlockManager's invariant check)."""
        return [plan.pinned for plan in self.plans.values()]

    def outcome(self, plan_id: int) -> Phase | None:
        plan = self.plans.get(plan_id)
        return plan.phase if plan is not None else self.ended.get(plan_id)

    def _existing(self, plan_id: int, role: Role) -> LocalPlan | None:
        if plan_id in self.ended:
            raise StalePlanError(f"plan {plan_id} already ended here ({self.ended[plan_id].value})")
        plan = self.plans.get(plan_id)
        if plan is not None and plan.role is not role:
            raise StalePlanError(f"plan {plan_id} is a {plan.role.value} here, not a {role.value}")
        return plan

    def _active(self, plan_id: int) -> LocalPlan | None:
        plan = self.plans.get(plan_id)
        if plan is None and plan_id not in self.ended:
            raise StalePlanError(f"plan {plan_id} was never prepared here")
        if plan is not None:
            plan.touched = self.clock()
        return plan

    def _open(self, plan: LocalPlan) -> LocalPlan:
        plan.touched = self.clock()
        self.plans[plan.plan_id] = plan
        return plan

    def _close(self, plan: LocalPlan, phase: Phase) -> None:
        del self.plans[plan.plan_id]
        self._remember(plan.plan_id, phase)

    def _remember(self, plan_id: int, phase: Phase) -> None:
        self.ended[plan_id] = phase
        while len(self.ended) > ENDED_PLANS_KEPT:
            self.ended.popitem(last=False)
