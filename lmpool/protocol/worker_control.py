"""The link between one worker and the control process: page-table reports and heartbeats
up; resync requests, transfer orders, questions and release outcomes down.

A worker's reports carry its ``epoch`` (its incarnation) so the page table rejects a dead
incarnation's late reports; deltas are versioned (``lmpool.protocol.kv_events``).
"""

from __future__ import annotations

from lmpool.protocol.base import BlockHash, LoadReport, Message, StepSample
from lmpool.protocol.cuda_ipc import CudaIpcExport
from lmpool.protocol.kv_events import KVDelta, KVSnapshot
from lmpool.protocol.transfer import Connect, PlanAnswer, QueryAnswer, TransferOrder, WorkerQuery


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


class StepTimings(Message, tag="steps"):
    """Steps the worker ran since its previous ``StepTimings``, for the control plane's step-time
    model (``lmpool.control.pricing.step_model``); ``calibration``: the synthetic steps a worker
    times at start, before it serves."""

    rank: int
    epoch: int
    samples: list[StepSample]
    calibration: bool = False
    # The step loop's synchronous stages since the worker started (``worker.loop_stages``):
    # stage -> [count, total ms, longest ms]; the readers wait while one runs.
    loop_ms: dict[str, list[float]] = {}


class ResyncRequest(Message, tag="resync"):
    """The control plane saw a gap in this worker's deltas: send a full snapshot."""

    rank: int


class ShortageReport(Message, tag="shortage"):
    """The worker can admit a waiting sequence only by evicting ``num_victims`` cold cached
    blocks: move them to a partner instead (``lmpool.control.transfers.foreground``). ``hashes`` holds
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


# ``CudaIpcExport`` travels worker -> control -> the worker it names, unopened.
WorkerToControl = (Heartbeat | WorkerSnapshot | WorkerDelta | StepTimings | ShortageReport | CudaIpcExport | PlanAnswer
                   | QueryAnswer)
ControlToWorker = ResyncRequest | Heartbeat | ReleaseOutcome | CudaIpcExport | Connect | TransferOrder | WorkerQuery
