"""The message vocabulary between LMPool's processes: engine (user process), control, workers.

Every message is a ``msgspec.Struct`` in a tagged union per direction, so each
receiver decodes exactly the types it expects and anything else is a decode
error. All are ``array_like`` (tagged unions need one wire shape) and
``gc=False``. KV bytes never travel here: block hashes,
ids and generations only.

Links (each a pair of rings):
- engine <-> control: request/response (``lmpool_ipc.Requester``): ``ControlRequest`` -> reply types.
- engine <-> worker r: ``EngineToWorker`` down, ``WorkerToEngine`` up.
- control <-> worker r: ``ControlToWorker`` down, ``WorkerToControl`` up.
"""

from __future__ import annotations

import msgspec

from lmpool.engine.hashing import BlockHash
from lmpool.engine.kv_events import KVDelta, KVSnapshot
from lmpool.sampling_params import SamplingParams
from lmpool.transfer.messages import CudaIpcExport


class Message(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of every message: positional arrays on the wire, defaults omitted, no GC tracking
    (messages hold no reference cycles)."""


class LoadReport(Message):
    """A worker's queue and capacity at one instant (what routing needs to cost a rank)."""

    num_waiting: int = 0
    num_running: int = 0
    waiting_prefill_tokens: int = 0  # prompt tokens not yet computed, over waiting and running
    decode_tokens_left: int = 0  # tokens still to generate by running sequences (max_tokens bound)
    blocks_free: int = 0
    blocks_reclaimable: int = 0
    blocks_used: int = 0
    prompt_tokens: int = 0  # cumulative prompt tokens admitted
    prefix_hit_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    admitted: list[str] = []  # request ids that reached the worker since the previous report
    generated_tokens: int = 0  # cumulative tokens this worker has emitted
    prefill_s_per_token: float = 0.0  # measured on prefill-heavy steps (EWMA); 0 until measured


# ---- engine <-> worker ---------------------------------------------------------------


class AddRequest(Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = []  # tokens already generated elsewhere (recompute after a failure)


class AbortRequest(Message, tag="abort"):
    request_id: str


class AttachControl(Message, tag="attach_control"):
    """Use this link end to reach a (re)started control process, and send it a full snapshot."""

    end: str


class Shutdown(Message, tag="shutdown"):
    pass


EngineToWorker = AddRequest | AbortRequest | AttachControl | Shutdown


class WorkerReady(Message, tag="ready"):
    rank: int
    pid: int
    num_blocks: int
    block_size: int


class WorkerFailed(Message, tag="failed"):
    """The worker could not start (or hit a fatal error); ``error`` says why."""

    rank: int
    error: str


class RequestRejected(Message, tag="rejected"):
    request_id: str
    error: str


class TokenDelta(Message):
    request_id: str
    token_id: int
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class StepOutputs(Message, tag="outputs"):
    outputs: list[TokenDelta]
    load: LoadReport


WorkerToEngine = WorkerReady | WorkerFailed | RequestRejected | StepOutputs


# ---- control <-> worker --------------------------------------------------------------


class Heartbeat(Message, tag="heartbeat"):
    rank: int
    epoch: int
    load: LoadReport | None = None


class WorkerSnapshot(Message, tag="snapshot"):
    rank: int
    epoch: int
    num_blocks: int
    snapshot: KVSnapshot
    load: LoadReport


class WorkerDelta(Message, tag="delta"):
    rank: int
    epoch: int
    delta: KVDelta
    load: LoadReport


class ResyncRequest(Message, tag="resync"):
    """The control plane saw a gap in this worker's deltas: send a full snapshot."""

    rank: int


class ShortageReport(Message, tag="shortage"):
    """The worker can admit a waiting sequence only by evicting ``num_victims`` cold cached
    blocks: move them to a partner instead (``lmpool.control.foreground``). ``hashes`` holds
    the victims' cached ancestors that are not victims, then the victims, parents before
    children, with each block's parent hash and generation."""

    rank: int
    epoch: int
    release_id: int
    hashes: list[BlockHash]
    parents: list[BlockHash]
    generations: list[int]
    num_victims: int  # the last ``num_victims`` of ``hashes``
    expected_reuses: float  # the victims' mean prefix-cache hits so far


class ReleaseOutcome(Message, tag="release"):
    """The control plane's answer to a ``ShortageReport``: ``state`` is "done" (the move
    completed), "aborted" (it started and failed) or "refused" (none was started)."""

    release_id: int
    state: str
    reason: str = ""




# ---- engine -> control (request/response) -----------------------------------------


class RouteQuery(Message, tag="route"):
    request_id: str
    block_hashes: list[BlockHash]  # chained hashes of the prompt's complete blocks
    num_prompt_tokens: int
    max_tokens: int


class RouteDecision(Message, tag="decision"):
    rank: int
    matched_blocks: int = 0  # prefix blocks the chosen rank already holds (as the page table saw them)
    reason: str = ""  # which rule chose the rank, for logs and benchmarks


class RankDown(Message, tag="rank_down"):
    """The engine saw rank ``rank`` die: forget its blocks and stop routing to it."""

    rank: int


class RankUp(Message, tag="rank_up"):
    rank: int
    epoch: int


class WaitRanks(Message, tag="wait_ranks"):
    """Reply once each of ``ranks`` has delivered a snapshot (or died): routing then sees them."""

    ranks: list[int]


class StatsQuery(Message, tag="stats"):
    pass


class RankState(Message, kw_only=True):
    rank: int
    alive: bool
    epoch: int
    snapshot_version: int
    heartbeat_age_s: float
    load: LoadReport
    cached_blocks: int


class TransferStats(Message, kw_only=True):
    """The control plane's KV transfer counters (all plans: explicit, background, foreground)."""

    plans_started: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    plans_open: int = 0
    blocks_copied: int = 0  # blocks of committed plans that the source kept
    blocks_moved: int = 0  # blocks of committed moves that the source gave up
    lease_routed: int = 0  # requests routed to a copy because of a placement lease
    leases: int = 0  # placement leases held now
    background_ticks: int = 0
    background_copies: int = 0  # committed background plans
    background_blocks: int = 0  # blocks they copied
    foreground_requests: int = 0  # shortage reports received
    foreground_moves: int = 0  # committed foreground plans
    foreground_refused: int = 0  # shortage reports answered without a move
    foreground_failed: int = 0  # foreground plans that aborted
    admission_admitted: int = 0
    admission_refused: int = 0
    placement_refused: dict[str, int] = {}  # background candidates refused, per gate
    in_flight_blocks: int = 0  # page-table entries marked in flight now
    reservations: int = 0  # route reservations held now


class ControlStats(Message, tag="control_stats", kw_only=True):
    pid: int
    ranks: list[RankState]
    route_queries: int
    route_p50_us: float
    route_p99_us: float
    resyncs: int
    stale_rejected: int
    transfers: TransferStats = msgspec.field(default_factory=TransferStats)




# ---- KV transfers (control <-> worker; engine -> control) ------------------------------


# Orders that are questions, answered by a ``TransferAck`` of the same ``phase`` and id:
# "digest" (of the KV bytes of ``hashes``) and "sync" (nothing: a barrier, since the answer
# follows on the worker's link everything it sent before taking the order).
QUERY_KINDS = ("digest", "sync")


class TransferOrder(Message, tag="xfer"):
    """One phase of a transfer plan for one worker (see ``lmpool.transfer.coordinator``),
    ``kind="connect"``: open the data path to ``peer`` under a fresh ``session``, or a
    question (``QUERY_KINDS``; ``plan_id`` is then the question's id)."""

    plan_id: int
    kind: str
    peer: int = -1
    session: int = 0
    num_blocks: int = 0
    move: bool = False
    hashes: list[BlockHash] = []
    generations: list[int] = []
    parents: list[BlockHash] = []
    block_ids: list[int] = []
    token_ids: list[list[int]] = []
    peer_block_ids: list[int] = []  # execute_recv: the source's blocks (a pull reads them directly)


class TransferAck(Message, tag="xfer_ack"):
    """A worker finished (``ok``) or failed one phase of a plan."""

    plan_id: int
    rank: int
    phase: str  # a ``PlanState`` value, or one of ``QUERY_KINDS``
    ok: bool
    error: str = ""
    block_ids: list[int] = []
    generations: list[int] = []
    token_ids: list[list[int]] = []
    digests: list[str] = []


class TransferChain(Message, tag="transfer_chain"):
    """Copy (or move) the cached chain ``block_hashes`` (complete blocks from the first) from
    ``src`` to ``dst``; the reply is a ``TransferResult`` once the plan has ended."""

    src: int
    dst: int
    block_hashes: list[BlockHash]
    move: bool = False


class TransferResult(Message, tag="transfer_result"):
    plan_id: int
    state: str  # "done" or "aborted"
    reason: str = ""
    seconds: float = 0.0  # from the plan's prepare to its end, on the control process's clock


class BlockDigests(Message, tag="block_digests"):
    """Ask ``rank`` for a digest of the KV bytes of each cached block in ``block_hashes``."""

    rank: int
    block_hashes: list[BlockHash]


class DigestsReply(Message, tag="digests"):
    digests: list[str]  # "" for a block the rank does not cache


# ---- the unions each receiver decodes ---------------------------------------------------

# ``CudaIpcExport`` (``lmpool.transfer.messages``) travels worker -> control -> the worker it names.
WorkerToControl = Heartbeat | WorkerSnapshot | WorkerDelta | TransferAck | ShortageReport | CudaIpcExport
ControlToWorker = ResyncRequest | Heartbeat | TransferOrder | ReleaseOutcome | CudaIpcExport
ControlRequest = RouteQuery | RankDown | RankUp | WaitRanks | StatsQuery | TransferChain | BlockDigests
