"""A worker's transfer executor: carries out the control plane's ``TransferOrder``s.

Block bookkeeping is the ``TransferParticipant``'s (pins, reservations,
publish, finalize, abort); this module adds the bytes: a source packs its
blocks of every layer into one ``[layers, 2, B, block_size, kv_heads, head_dim]``
payload and sends it once, a destination receives it into a buffer and only
then scatters it into its reserved blocks. Transport operations run on the
transport's own threads; ``progress()`` polls them between engine steps, so the
step loop never waits for bytes.

Every order is answered with one ``TransferAck`` (ok or not); an order for a
plan this worker no longer knows (aborted, expired) is answered as failed and
changes nothing. A receive that completes after its plan was aborted is
dropped without touching the cache.
"""

from __future__ import annotations

import hashlib

import torch

from lmpool.engine.block_manager import StaleBlockError
from lmpool.engine.core import EngineCore
from lmpool.pool.messages import TransferAck, TransferOrder
from lmpool.pool.spec import WorkerSpec
from lmpool.transfer import GlooTransport, TransportError, plan_tag
from lmpool.transfer.transactions import StalePlanError, TransferParticipant

PHASE = {
    "prepare_source": "preparing", "prepare_dest": "preparing",
    "execute_send": "executing", "execute_recv": "executing",
    "publish": "publishing", "finalize": "finalizing",
}


class TransferExecutor:
    def __init__(self, spec: WorkerSpec, core: EngineCore) -> None:
        if core.runner.device.type != "cpu":
            raise ValueError("KV transfers are wired for CPU replicas (gloo) only so far")
        self.rank = spec.rank
        self.core = core
        self.participant = TransferParticipant(core.block_manager, lease_s=spec.transfer_lease_s)
        self.transport = GlooTransport(spec.transfer_rendezvous, spec.rank, spec.world_size)
        self.orders: list[TransferOrder] = []
        # (order, handle, receive buffer or None)
        self.in_flight: list[tuple[TransferOrder, object, torch.Tensor | None]] = []

    @property
    def busy(self) -> bool:
        return bool(self.orders or self.in_flight)

    def close(self) -> None:
        self.transport.close()

    def progress(self) -> list[TransferAck]:
        """Take new orders, collect finished transport operations; return the acks to send."""
        acks = []
        orders, self.orders = self.orders, []
        for order in orders:
            ack = self._start(order)
            if ack is not None:
                acks.append(ack)
        still = []
        for order, handle, buffer in self.in_flight:
            if not handle.done():
                still.append((order, handle, buffer))
                continue
            acks.append(self._finish(order, handle, buffer))
        self.in_flight = still
        return acks

    def _ack(self, order: TransferOrder, ok: bool = True, error: str = "", **fields) -> TransferAck:
        return TransferAck(order.plan_id, self.rank, PHASE.get(order.kind, order.kind), ok, error, **fields)

    def _start(self, order: TransferOrder) -> TransferAck | None:
        p, bm, runner = self.participant, self.core.block_manager, self.core.runner
        try:
            if order.kind == "connect":
                self.transport.connect(order.peer, order.session)
                return None
            if order.kind == "prepare_source":
                plan = p.prepare_source(order.plan_id, order.hashes, order.generations)
                return self._ack(order, block_ids=plan.block_ids, token_ids=plan.token_ids)
            if order.kind == "prepare_dest":
                plan = p.prepare_dest(order.plan_id, order.num_blocks)
                return self._ack(order, block_ids=plan.block_ids,
                                 generations=[bm.blocks[b].generation for b in plan.block_ids])
            if order.kind == "execute_send":
                plan = p.plans.get(order.plan_id)
                if plan is None:
                    raise StalePlanError(f"plan {order.plan_id} is not open here")
                payload = runner.ops.pack_kv(runner.kv_cache, torch.tensor(plan.block_ids))
                self.in_flight.append((order, self.transport.send(order.peer, payload, plan_tag(order.plan_id)), None))
                return None
            if order.kind == "execute_recv":
                plan = p.plans.get(order.plan_id)
                if plan is None:
                    raise StalePlanError(f"plan {order.plan_id} is not open here")
                cache = runner.kv_cache
                shape = (cache.shape[0], 2, len(plan.block_ids), *cache.shape[3:])
                buffer = torch.empty(shape, dtype=cache.dtype)
                self.in_flight.append((order, self.transport.recv(order.peer, buffer, plan_tag(order.plan_id)), buffer))
                return None
            if order.kind == "publish":
                p.publish(order.plan_id, order.hashes, order.parents, order.token_ids)
                return self._ack(order)
            if order.kind == "finalize":
                p.finalize(order.plan_id, order.move)
                return self._ack(order)
            if order.kind == "abort":
                p.abort(order.plan_id)
                return None
            if order.kind == "digest":
                return self._ack(order, digests=[self.digest(h) for h in order.hashes])
            raise ValueError(f"unknown transfer order {order.kind!r}")
        except (StaleBlockError, StalePlanError, TransportError, RuntimeError, ValueError) as e:
            return self._ack(order, ok=False, error=f"{type(e).__name__}: {e}")

    def _finish(self, order: TransferOrder, handle, buffer: torch.Tensor | None) -> TransferAck:
        try:
            handle.wait(0)
        except TransportError as e:
            return self._ack(order, ok=False, error=f"{type(e).__name__}: {e}")
        plan = self.participant.plans.get(order.plan_id)
        if plan is None:  # aborted while the bytes moved: leave the cache alone
            return self._ack(order, ok=False, error=f"plan {order.plan_id} ended before its bytes arrived")
        if buffer is not None:
            runner = self.core.runner
            runner.ops.unpack_kv(runner.kv_cache, torch.tensor(plan.block_ids), buffer)
        self.participant.executed(order.plan_id)
        return self._ack(order)

    def digest(self, block_hash: int) -> str:
        """SHA-256 of a cached block's KV bytes in every layer ("" if not cached here)."""
        block_id = self.core.block_manager.hash_to_block.get(block_hash)
        if block_id is None:
            return ""
        runner = self.core.runner
        data = runner.ops.pack_kv(runner.kv_cache, torch.tensor([block_id])).contiguous()
        return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
