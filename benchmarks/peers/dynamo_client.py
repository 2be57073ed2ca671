"""The pool's ``stream(prompt, params, rank=...)`` with NVIDIA Dynamo's KV router choosing the
rank, as ``eval_driver.replay`` drives a pool.

Each request asks Dynamo's ``SelectionService`` (``ai-dynamo-runtime``'s runtime-free selection
core) with its prompt's token ids: ``select_and_reserve`` picks a worker by Dynamo's cost (the
prefill of the prompt's uncached tokens plus the worker's active blocks, from its KV index and
its own bookings) and books the request's load there. The request then runs on that rank, pinned:
the pool's own routing never runs. Its booking follows the lifecycle Dynamo's frontend gives it
(``KvPushRouter::generate`` in ai-dynamo/dynamo ``lib/llm/src/kv_router.rs``):

- booked when routed (``select_and_reserve``, under a ``selection_id`` of its own);
- prefill complete at the first output that carries tokens (``prefill_complete``: its prefill
  tokens leave the worker's load, its blocks stay);
- freed once the stream ends, however it ends (``free_reservation``: its blocks leave too).

Output blocks are not added one by one (``add_output_block``): Dynamo does that only with
``router_track_output_blocks``, off by default. A request the trace pins to a rank is booked there
(``pinned_worker``), as Dynamo books a request sent to a named worker, so its load counts in later
choices; its route is ``pinned``, every other one ``dynamo_select``.

Worker ``r`` is the pool's rank ``r`` with data-parallel rank ``r`` (``eval_dynamo`` registers them).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator

import msgspec


class DynamoRoutedPool:
    def __init__(self, pool, service, world_size: int) -> None:
        self.pool = pool
        self.service = service  # dynamo.llm.SelectionService, its workers registered
        self.world_size = world_size
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)
        self.selected = 0  # requests Dynamo chose a rank for
        self.pinned = 0  # requests booked on the rank the trace pinned them to
        self.prefill_completed = 0
        self.freed = 0

    async def stream(self, prompt, params, rank: int | None = None) -> AsyncIterator:
        selection_id = f"{self._prefix}-{next(self._ids)}"
        ask: dict = {"token_ids": list(prompt), "selection_id": selection_id}
        if rank is not None:
            ask["pinned_worker"] = {"worker_id": rank, "dp_rank": rank}
        try:
            chosen = await self.service.select_and_reserve(ask)
        except BaseException:
            await self._free_if_booked(selection_id)  # cancelled while Dynamo booked it, say
            raise
        try:
            target = self._rank_of(chosen, rank)
            if rank is None:
                self.selected += 1
                route = f"dynamo_select r{target} prefill={chosen.get('effective_prefill_tokens')}"
            else:
                self.pinned += 1
                route = "pinned"
            prefilled = False
            # Closed here however this stream ends, so the pool has ended the request (aborted it,
            # when the reader left early) before Dynamo frees its booking.
            async with contextlib.aclosing(self.pool.stream(prompt, params, rank=target)) as outs:
                async for out in outs:
                    if out.rank != target:
                        raise RuntimeError(f"Dynamo chose rank {target}, rank {out.rank} served the request")
                    if not prefilled and out.token_ids:
                        await self.service.prefill_complete(selection_id)
                        self.prefill_completed += 1
                        prefilled = True
                    yield msgspec.structs.replace(out, route=route)
        finally:
            await self.service.free_reservation(selection_id)
            self.freed += 1

    def _rank_of(self, chosen: dict, pinned: int | None) -> int:
        worker, dp_rank = chosen.get("worker_id"), chosen.get("dp_rank")
        if worker != dp_rank or not isinstance(worker, int) or not 0 <= worker < self.world_size:
            raise RuntimeError(f"Dynamo chose worker {worker} rank {dp_rank}, not one of this pool's ranks")
        if pinned is not None and worker != pinned:
            raise RuntimeError(f"a request pinned to rank {pinned} was booked on rank {worker}")
        return worker

    async def _free_if_booked(self, selection_id: str) -> None:
        from dynamo.llm.exceptions import SelectionServiceError

        with contextlib.suppress(SelectionServiceError):  # "reservation ... not found": never booked
            await self.service.free_reservation(selection_id)
