"""Every message that crosses a process boundary, one module per link, one tagged union per
direction (see docs/ARCHITECTURE.md for the picture):

- ``frontend_worker``: user process <-> worker (``FrontendToWorker``, ``WorkerToFrontend``);
- ``frontend_control``: user process -> control process requests (``FrontendToControl``);
- ``worker_control``: worker <-> control process (``WorkerToControl``, ``ControlToWorker``);
- ``transfer``: KV transfer plan orders and answers, set-up and questions;
- ``kv_events``, ``cuda_ipc``: payloads those links carry; ``spec``: a child's start-up spec;
  ``state_board``: the pool state the control process publishes for monitors.

KV bytes never travel here: block hashes, ids and generations only.
"""

from lmpool.protocol.base import LoadReport, Message, StepSample
from lmpool.protocol.cuda_ipc import CudaIpcExport, IpcStorage
from lmpool.protocol.frontend_control import (
    BlockDigests,
    ControlStats,
    DigestsReply,
    FrontendToControl,
    Quiesce,
    RankDown,
    RankState,
    RankUp,
    ReleaseRoute,
    RouteDecision,
    RouteQuery,
    StatsQuery,
    StepFit,
    StepKindFit,
    TransferChain,
    TransferResult,
    TransferStats,
    WaitRanks,
)
from lmpool.protocol.frontend_worker import (
    AbortRequest,
    AddRequest,
    AttachControl,
    FrontendToWorker,
    RequestRejected,
    Shutdown,
    StepOutputs,
    TokenDelta,
    WorkerFailed,
    WorkerReady,
    WorkerToFrontend,
)
from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVEvent, KVSnapshot
from lmpool.protocol.transfer import (
    ORDERS,
    SUCCESS,
    AbortPlan,
    Connect,
    DestPrepared,
    DigestAnswer,
    DigestQuery,
    Executed,
    ExecuteRecv,
    ExecuteSend,
    Finalize,
    Finalized,
    PhaseFailed,
    PlanAnswer,
    PlanOrder,
    PlanState,
    PrepareDest,
    PrepareSource,
    Publish,
    Published,
    QueryAnswer,
    SourcePrepared,
    SyncAnswer,
    SyncQuery,
    TransferOrder,
    WorkerQuery,
)
from lmpool.protocol.worker_control import (
    ControlToWorker,
    Heartbeat,
    ReleaseOutcome,
    ResyncRequest,
    ShortageReport,
    StepTimings,
    WorkerDelta,
    WorkerSnapshot,
    WorkerToControl,
)

__all__ = [
    "AbortPlan", "AbortRequest", "AddRequest", "AttachControl", "BlockDigests", "BlockRemoved", "BlockStored",
    "Connect", "ControlStats", "ControlToWorker", "CudaIpcExport", "DestPrepared", "DigestAnswer", "DigestQuery",
    "DigestsReply", "ExecuteRecv", "ExecuteSend", "Executed", "Finalize", "Finalized", "FrontendToControl",
    "FrontendToWorker", "Heartbeat", "IpcStorage", "KVDelta", "KVEvent", "KVSnapshot", "LoadReport", "Message",
    "ORDERS", "PhaseFailed", "PlanAnswer", "PlanOrder", "PlanState", "PrepareDest", "PrepareSource", "Publish",
    "Published", "QueryAnswer", "RankDown", "RankState", "RankUp", "ReleaseOutcome", "ReleaseRoute", "RequestRejected",
    "Quiesce", "ResyncRequest", "RouteDecision", "RouteQuery", "SUCCESS", "ShortageReport", "Shutdown",
    "SourcePrepared", "StatsQuery", "StepFit", "StepKindFit", "StepOutputs", "StepSample", "StepTimings",
    "SyncAnswer", "SyncQuery", "TokenDelta", "TransferChain", "TransferOrder", "TransferResult", "TransferStats",
    "WaitRanks", "WorkerDelta", "WorkerFailed", "WorkerQuery", "WorkerReady", "WorkerSnapshot", "WorkerToControl",
    "WorkerToFrontend",
]
