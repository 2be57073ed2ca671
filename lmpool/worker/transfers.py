"""A worker's transfer executor: carries out the control plane's transfer orders. Block
bookkeeping is the ``TransferParticipant``'s; this module adds the bytes, over the data path the
pair's devices give it: a pull through CUDA IPC, or packed layer chunks over gloo or NCCL
(docs/ARCHITECTURE.md, "Data paths"). ``Connect`` sets a pair up (on CUDA through exports the
control plane relays); ``progress()`` polls operations between engine steps, so the step loop
never waits for bytes.

Invariants:
- a pull never reads a block still being written. A cached block's bytes are complete when it
  gets its hash under overlapped stepping (a step's blocks are committed after its read-back; a
  destination publishes after its copy or last unpack completed), so a source answers ``prepare``
  at once, even while a step runs; under serial stepping, which commits a step's blocks at its
  launch, only once every GPU write issued before has completed. It holds its pins until
  finalize or abort.
- a destination answers a pull only after its copy completed while the source was alive; it
  copies on its compute stream, so blocks an abort frees are reused only after the copy.
- every plan order is answered once, with its phase's success struct or ``PhaseFailed``, except
  ``AbortPlan``; an order for a plan this worker no longer knows fails and changes nothing;
  bytes that arrive after their plan was aborted are dropped.
- with ``LMPOOL_CHECK_INVARIANTS=1`` the block manager's invariants, open plans' pins included,
  are checked after every poll that handled something (tests break plans at exact points
  through ``lmpool.dataplane.faults``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from lmpool.dataplane import GlooTransport, TransportError, kind_for_devices
from lmpool.dataplane.chunked import BlockReceiver, send_blocks
from lmpool.dataplane.faults import FaultPlan, InjectedFault
from lmpool.dataplane.transactions import StalePlanError, TransferParticipant
from lmpool.engine.block_manager import StaleBlockError
from lmpool.engine.core import EngineCore
from lmpool.protocol import (
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
    PhaseFailed,
    PlanAnswer,
    PlanOrder,
    PrepareDest,
    PrepareSource,
    Publish,
    QueryAnswer,
    SourcePrepared,
    SyncAnswer,
    SyncQuery,
)
from lmpool.protocol.base import BlockHash
from lmpool.protocol.cuda_ipc import CudaIpcExport
from lmpool.protocol.spec import WorkerSpec

if TYPE_CHECKING:
    from lmpool.dataplane.cuda_ipc import CudaIpcTransport
    from lmpool.dataplane.nccl import NcclTransport
    from lmpool.dataplane.transport import Handle

# A pull of a few blocks takes tens of microseconds: waiting that long right after
# starting it saves the step loop's next poll (which comes after a pause while idle).
SETTLE_S = 100e-6
FAILURES = (StaleBlockError, StalePlanError, TransportError, RuntimeError, ValueError)
Incoming = PlanOrder | Connect | DigestQuery | SyncQuery | CudaIpcExport  # what the control plane sends
Outgoing = PlanAnswer | QueryAnswer | CudaIpcExport


class _GpuDone:
    """A handle that is done once the GPU has passed this point of ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout: float) -> None:
        pass  # only waited on once done: nothing can fail


@dataclass
class _Pending:
    order: PlanOrder
    handle: Handle
    finish: Callable[[], PlanAnswer]  # the answer, once the handle is done without error
    silent: bool = False  # an injected fault lost its ack


class TransferExecutor:
    def __init__(self, spec: WorkerSpec, core: EngineCore) -> None:
        runner = core.runner
        assert spec.transfer_rendezvous is not None  # a worker makes one only for a pool with transfers
        self.rank = spec.rank
        self.world_size = spec.pool.world_size
        self.core = core
        self.device = runner.device
        self.rendezvous = spec.transfer_rendezvous
        self.gpu_transfer_path = spec.pool.transfer.gpu_transfer_path
        self.participant = TransferParticipant(core.block_manager, lease_s=spec.pool.transfer.transfer_lease_s)
        self.ipc: CudaIpcTransport | None = None
        # gloo (CPU), or NCCL once a peer cannot be pulled from
        self.packed: GlooTransport | NcclTransport | None = None
        if self.device.type == "cpu":
            self.packed = GlooTransport(spec.transfer_rendezvous, spec.rank, self.world_size)
        else:
            from lmpool.dataplane.cuda_ipc import CudaIpcTransport

            self.ipc = CudaIpcTransport(spec.transfer_rendezvous, spec.rank, self.world_size, device=str(self.device),
                                        kv_cache=runner.kv_cache, use_kernels=runner.ops.name.startswith("cuda"))
        self.paths: dict[int, str] = {}  # peer -> "pull" | "packed"
        self.broken: dict[int, str] = {}  # peer -> why its data path could not be set up
        self.orders: list[tuple[Incoming, float]] = []  # with when each arrived (``time.monotonic``)
        self.in_flight: list[_Pending] = []
        self.faults = FaultPlan.from_env(spec.rank, spec.epoch)
        self.check = os.environ.get("LMPOOL_CHECK_INVARIANTS") == "1"

    def receive(self, order: Incoming) -> None:
        """An order from the control link, taken at the next ``progress``."""
        self.orders.append((order, time.monotonic()))

    @property
    def busy(self) -> bool:
        return bool(self.orders or self.in_flight)

    def close(self) -> None:
        for transport in (self.ipc, self.packed):
            if transport is not None:
                transport.close()

    def progress(self) -> list[Outgoing]:
        """Take new orders, collect finished operations; return the messages for the control plane."""
        out = []
        orders, self.orders = self.orders, []
        started, now = len(self.in_flight), time.monotonic()
        for order, arrived in orders:
            msg = self._start(order, now - arrived)
            if msg is not None:
                out.append(msg)
        self._settle(self.in_flight[started:])
        still = []
        for pending in self.in_flight:
            if not pending.handle.done():
                still.append(pending)
                continue
            ack = self._finish(pending)
            if ack is not None:
                out.append(ack)
        handled = orders or len(still) != len(self.in_flight)
        self.in_flight = still
        if self.check and handled:
            self.check_invariants()
        return out

    def check_invariants(self) -> None:
        """The block manager's invariants, counting every live sequence's and open plan's blocks."""
        tables = [seq.block_table for seq in self.core.requests.values()]
        self.core.block_manager.check_invariants(tables + self.participant.held_blocks())

    def _settle(self, new: list[_Pending]) -> None:
        """Give operations just started on the GPU a moment to complete (bounded)."""
        if self.device.type != "cuda" or not new:
            return
        deadline = time.perf_counter() + SETTLE_S
        while not all(p.handle.done() for p in new) and time.perf_counter() < deadline:
            pass

    def _done(self, order: PlanOrder) -> PlanAnswer:
        """The answer to an order that succeeded and has no result to carry."""
        return SUCCESS[order.phase](order.plan_id, self.rank)

    def _failed(self, order: PlanOrder, error: BaseException) -> PhaseFailed:
        return PhaseFailed(order.plan_id, self.rank, order.phase.value, f"{type(error).__name__}: {error}",
                           data_path=isinstance(error, TransportError))

    # ---- orders -----------------------------------------------------------------------

    def _start(self, order: Incoming, held_s: float) -> Outgoing | None:
        """Act on ``order``, which waited ``held_s`` here for the step loop (a prepare's answer
        says so: the first phase of a pull waits for its slower side)."""
        if isinstance(order, CudaIpcExport):
            self._accept(order)
            return None
        if isinstance(order, Connect):
            return self._connect(order)
        if isinstance(order, (DigestQuery, SyncQuery)):
            return self._answer(order)
        ack = self._act(order, held_s)
        return None if ack is None else self._after(order, ack)

    def _after(self, order: PlanOrder, ack: PlanAnswer) -> PlanAnswer | None:
        """``ack``, unless a fault injected once the order was acted on loses or fails it."""
        try:
            if self.faults.hit(order.kind, "after") == "drop":
                return None
        except InjectedFault as e:
            return self._failed(order, e)
        return ack

    def _during(self, pending: _Pending) -> None:
        """Injected faults while ``pending``'s bytes are in flight."""
        try:
            if self.faults.hit(pending.order.kind, "during") == "drop":
                pending.silent = True
        except InjectedFault:
            self.in_flight.remove(pending)  # the bytes may still land; nobody acts on them
            raise

    def _act(self, order: PlanOrder, held_s: float) -> PlanAnswer | None:
        p, bm = self.participant, self.core.block_manager
        try:
            if self.faults.hit(order.kind, "before") == "drop":
                return None
            if isinstance(order, PrepareSource):
                plan = p.prepare_source(order.plan_id, order.hashes, order.generations)
                return self._when_written(order,
                                          SourcePrepared(order.plan_id, self.rank, plan.block_ids, plan.token_ids,
                                                         held_s))
            if isinstance(order, PrepareDest):
                plan = p.prepare_dest(order.plan_id, order.num_blocks, order.anchor, order.anchor_generation)
                return DestPrepared(order.plan_id, self.rank, plan.block_ids,
                                    [bm.blocks[b].generation for b in plan.block_ids], held_s)
            if isinstance(order, ExecuteSend):
                return self._execute_send(order)
            if isinstance(order, ExecuteRecv):
                return self._execute_recv(order)
            if isinstance(order, Publish):
                p.publish(order.plan_id, order.hashes, order.parents, order.token_ids)
            elif isinstance(order, Finalize):
                p.finalize(order.plan_id, order.move, order.keep)
            elif isinstance(order, AbortPlan):
                p.abort(order.plan_id)
                return None
            return self._done(order)
        except FAILURES as e:
            return self._failed(order, e)

    def _answer(self, query: DigestQuery | SyncQuery) -> QueryAnswer:
        if isinstance(query, SyncQuery):
            return SyncAnswer(query.query_id, self.rank)
        return DigestAnswer(query.query_id, self.rank, [self.digest(h) for h in query.hashes])

    def _connect(self, order: Connect) -> CudaIpcExport | None:
        self.broken.pop(order.peer, None)
        if self.ipc is None:
            assert self.packed is not None  # without CUDA IPC (CPU replicas), gloo from the start
            self.packed.connect(order.peer, order.session)
            self.paths[order.peer] = "packed"
            return None
        # The path is chosen once the peer's export says where its memory is; until then an
        # earlier path to the same peer (a reconnect after a control restart) stays usable.
        return self.ipc.export(peer=order.peer, pair_session=order.session)

    def _accept(self, export: CudaIpcExport) -> None:
        """A peer's export, relayed by the control plane: set up the data path to it."""
        peer = export.rank
        if self.ipc is None or export.peer != self.rank or not 0 <= peer < self.world_size or peer == self.rank:
            return  # not for this CUDA replica, or not from a peer: nothing to set up
        from lmpool.dataplane.cuda_ipc import can_reach

        try:
            # Both ends have the same setting and see the same pair, so they pick the same path.
            reach = self.gpu_transfer_path == "auto" and can_reach(self.device.index, export.device)
            kind = kind_for_devices(str(self.device), f"cuda:{export.device}", peer_access=reach)
            if kind == "cuda_ipc":
                self.ipc.connect(export)
                self.paths[peer] = "pull"
            else:
                self._nccl().connect(peer, export.pair_session)
                self.paths[peer] = "packed"
            self.broken.pop(peer, None)
        except (TransportError, RuntimeError, ValueError) as e:
            self.paths.pop(peer, None)
            self.broken[peer] = f"{type(e).__name__}: {e}"

    def _nccl(self):
        if self.packed is None:
            from lmpool.dataplane.nccl import NcclTransport

            self.packed = NcclTransport(self.rendezvous, self.rank, self.world_size, device=str(self.device))
        return self.packed

    def _path(self, peer: int) -> str:
        path = self.paths.get(peer)
        if path is None:
            reason = self.broken.get(peer, "its connection is not set up yet")
            raise TransportError(f"rank {self.rank} has no data path to rank {peer}: {reason}")
        return path

    def _when_written(self, order: PlanOrder, ack: PlanAnswer) -> PlanAnswer | None:
        """``ack`` now if every cached block's bytes are complete (the module docstring), else
        once every GPU write issued so far has completed."""
        if (self.device.type != "cuda" or self.core.config.async_scheduling
                or torch.cuda.current_stream(self.device).query()):
            return ack
        self.in_flight.append(_Pending(order, _GpuDone(self.device), lambda: ack))
        return None

    def _open_plan(self, order: PlanOrder):
        plan = self.participant.plans.get(order.plan_id)
        if plan is None:
            raise StalePlanError(f"plan {order.plan_id} is not open here")
        return plan

    def _execute_send(self, order: ExecuteSend) -> PlanAnswer | None:
        plan = self._open_plan(order)
        if self._path(order.peer) == "pull":
            # The destination copies the blocks; they stay pinned here until finalize.
            if self.faults.hit(order.kind, "during") == "drop":
                return None
            self.participant.executed(order.plan_id)
            return self._done(order)
        runner = self.core.runner
        handle = send_blocks(self.packed, order.peer, runner.ops, runner.kv_cache,
                             torch.tensor(plan.block_ids, device=self.device), order.plan_id)
        self._pend(_Pending(order, handle, lambda: self._executed(order)))
        return None

    def _pend(self, pending: _Pending) -> None:
        self.in_flight.append(pending)
        self._during(pending)

    def _execute_recv(self, order: ExecuteRecv) -> PlanAnswer | None:
        plan = self._open_plan(order)
        if self._path(order.peer) == "pull":
            if len(order.peer_block_ids) != len(plan.block_ids):
                raise ValueError(f"execute_recv of plan {order.plan_id} names {len(order.peer_block_ids)} source "
                                 f"blocks for {len(plan.block_ids)} reserved ones")
            assert self.ipc is not None  # the "pull" path is CUDA IPC's
            handle: Handle = self.ipc.pull(order.peer, order.peer_block_ids, plan.block_ids)
            self._pend(_Pending(order, handle, lambda: self._executed(order, pulled=True)))
            return None
        runner = self.core.runner
        # Chunks are unpacked as they arrive, only while the plan is open: bytes of a plan
        # aborted meanwhile are dropped, never written into blocks it no longer reserves.
        handle = BlockReceiver(self.packed, order.peer, runner.ops, runner.kv_cache,
                               torch.tensor(plan.block_ids, device=self.device), order.plan_id,
                               wanted=lambda: order.plan_id in self.participant.plans)
        self._pend(_Pending(order, handle, lambda: self._executed(order)))
        return None

    def _executed(self, order: PlanOrder, pulled: bool = False) -> PlanAnswer:
        if order.plan_id not in self.participant.plans:  # aborted while the bytes moved
            raise StalePlanError(f"plan {order.plan_id} ended before its bytes arrived")
        self.participant.executed(order.plan_id)
        return Executed(order.plan_id, self.rank, pulled=pulled)

    def _finish(self, pending: _Pending) -> PlanAnswer | None:
        try:
            pending.handle.wait(0)
            ack = pending.finish()
        except FAILURES as e:
            ack = self._failed(pending.order, e)
        return None if pending.silent else self._after(pending.order, ack)

    def digest(self, block_hash: BlockHash) -> str:
        """SHA-256 of a cached block's KV bytes in every layer ("" if not cached here)."""
        block_id = self.core.block_manager.hash_to_block.get(block_hash)
        if block_id is None:
            return ""
        runner = self.core.runner
        data = runner.ops.pack_kv(runner.kv_cache, torch.tensor([block_id], device=self.device))
        return hashlib.sha256(data.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
