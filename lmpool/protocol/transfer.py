"""KV transfer plans on the wire: one order per phase (control -> worker), one answer per
outcome (worker -> control), plus the set-up order and the two questions a worker answers.

A plan runs PREPARING -> EXECUTING -> PUBLISHING -> FINALIZING -> DONE, or ABORTED from
any phase (``lmpool.control.transfers.coordinator``). Each order names its phase
(``phase``); a worker answers it with that phase's success struct or ``PhaseFailed``,
never both, and an ``AbortPlan`` with nothing. Questions carry a ``query_id`` and are
answered on the same FIFO link, after everything the worker sent before taking them.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from lmpool.protocol.base import BlockHash, Message


class PlanState(enum.Enum):
    PREPARING = "preparing"
    EXECUTING = "executing"
    PUBLISHING = "publishing"
    FINALIZING = "finalizing"
    DONE = "done"
    ABORTED = "aborted"


# ---- control -> worker: orders -----------------------------------------------------------


class PlanOrder(Message):
    """An order for one phase of plan ``plan_id``; ``kind`` names it (fault injection, logs)."""

    plan_id: int
    kind: ClassVar[str]
    phase: ClassVar[PlanState]


class PrepareSource(PlanOrder, tag="prepare_source"):
    """Pin the cached blocks ``hashes`` at ``generations``; answer ``SourcePrepared``."""

    kind = "prepare_source"
    phase = PlanState.PREPARING
    hashes: list[BlockHash]
    generations: list[int]


class PrepareDest(PlanOrder, tag="prepare_dest"):
    """Reserve ``num_blocks`` free blocks; answer ``DestPrepared``. With an ``anchor`` (the
    cached block, at ``anchor_generation``, that the plan's first block hangs off), pin it and
    its ancestors first, until the plan ends: making room must not evict the chain the copy
    continues."""

    kind = "prepare_dest"
    phase = PlanState.PREPARING
    num_blocks: int
    anchor: BlockHash = b""  # ROOT_HASH: none
    anchor_generation: int = 0


class ExecuteSend(PlanOrder, tag="execute_send"):
    """Send the pinned ``block_ids`` to ``peer`` (nothing to do when the peer pulls)."""

    kind = "execute_send"
    phase = PlanState.EXECUTING
    peer: int
    block_ids: list[int]


class ExecuteRecv(PlanOrder, tag="execute_recv"):
    """Fill the reserved ``block_ids`` from ``peer``'s ``peer_block_ids`` (pulled, or received)."""

    kind = "execute_recv"
    phase = PlanState.EXECUTING
    peer: int
    block_ids: list[int]
    peer_block_ids: list[int]


class Publish(PlanOrder, tag="publish"):
    """Make the received blocks cached under ``hashes`` (with ``parents`` and ``token_ids``)."""

    kind = "publish"
    phase = PlanState.PUBLISHING
    hashes: list[BlockHash]
    parents: list[BlockHash]
    token_ids: list[list[int]]


class Finalize(PlanOrder, tag="finalize"):
    """Drop the source's pins; a ``move`` frees its blocks but the first ``keep``."""

    kind = "finalize"
    phase = PlanState.FINALIZING
    move: bool = False
    keep: int = 0


class AbortPlan(PlanOrder, tag="abort_plan"):
    """Release whatever the plan holds here; the source keeps its blocks. Not answered."""

    kind = "abort"
    phase = PlanState.ABORTED


class Connect(Message, tag="connect"):
    """Open the data path to ``peer`` under a fresh ``session`` (both ends get one)."""

    kind: ClassVar[str] = "connect"
    peer: int
    session: int


class DigestQuery(Message, tag="digest_query"):
    """Answer a ``DigestAnswer`` with a digest of the KV bytes of each cached block of ``hashes``."""

    kind: ClassVar[str] = "digest"
    query_id: int
    hashes: list[BlockHash]


class SyncQuery(Message, tag="sync_query"):
    """Answer a ``SyncAnswer``: a barrier after everything sent before it."""

    kind: ClassVar[str] = "sync"
    query_id: int


ORDERS = (PrepareSource, PrepareDest, ExecuteSend, ExecuteRecv, Publish, Finalize, AbortPlan)
TransferOrder = PrepareSource | PrepareDest | ExecuteSend | ExecuteRecv | Publish | Finalize | AbortPlan
WorkerQuery = DigestQuery | SyncQuery


# ---- worker -> control: answers -----------------------------------------------------------


class PhaseAnswer(Message):
    plan_id: int
    rank: int


class SourcePrepared(PhaseAnswer, tag="source_prepared"):
    phase = PlanState.PREPARING
    block_ids: list[int]
    token_ids: list[list[int]]
    # From the worker's reader taking the order off the link to its loop acting on it (an order
    # that waits in the link for a loop that does not yield is not counted: ``worker.loop_stages``).
    held_s: float = 0.0


class DestPrepared(PhaseAnswer, tag="dest_prepared"):
    phase = PlanState.PREPARING
    block_ids: list[int]
    generations: list[int]
    held_s: float = 0.0  # as ``SourcePrepared``'s


class Executed(PhaseAnswer, tag="executed"):
    phase = PlanState.EXECUTING
    # The destination read the source's pinned blocks itself (CUDA IPC): the bytes are in place
    # and the source's own execute, which has nothing to do, is not waited for.
    pulled: bool = False


class Published(PhaseAnswer, tag="published"):
    phase = PlanState.PUBLISHING


class Finalized(PhaseAnswer, tag="finalized"):
    phase = PlanState.FINALIZING


class PhaseFailed(PhaseAnswer, tag="phase_failed"):
    """The worker could not carry out its order for ``phase`` (a ``PlanState`` value)."""

    phase_name: str
    error: str
    # The error was the pair's data path (``TransportError``): it stays broken until both ends
    # connect again (``lmpool.control.transfers.data_paths``). Last, defaulting to False: a sender
    # from before it still decodes.
    data_path: bool = False

    @property
    def phase(self) -> PlanState:
        return PlanState(self.phase_name)


class DigestAnswer(Message, tag="digest_answer"):
    query_id: int
    rank: int
    digests: list[str]  # "" for a block the rank does not cache


class SyncAnswer(Message, tag="sync_answer"):
    query_id: int
    rank: int


PlanAnswer = SourcePrepared | DestPrepared | Executed | Published | Finalized | PhaseFailed
QueryAnswer = DigestAnswer | SyncAnswer
# What answers an order of each phase when it succeeds.
SUCCESS = {PlanState.EXECUTING: Executed, PlanState.PUBLISHING: Published, PlanState.FINALIZING: Finalized}
