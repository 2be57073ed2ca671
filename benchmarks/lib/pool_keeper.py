"""The suite's pools: one per run, or one kept across the runs whose workers it can serve.

A fresh pool per run (``--fresh-pools``) starts every run on empty caches, with no learned
state, and pays a start (workers, engines, graphs, calibration: most of a GPU run's time).
Kept (the default), a pool serves every run of LMPool's own policies at one KV budget whose
workers would be set up alike, and is reset between runs (``AsyncLMPool.reset``): its caches
emptied, its control process replaced by one of the next policy's routing rule and transfer
mode. Its workers are started with transfers set up, so a routing-only policy runs beside a
data path it never uses. A kept pool first replays its first run's trace once, unmeasured,
and is reset: every measured run then meets warm engines, whatever its place in the order.

Dynamo's router runs in front of a kept pool too (reset to round robin, publishing KV events);
the real SGLang gateway's run closes it (its hosts are processes of their own).

Invariants: at most one pool is up at a time; every run starts on empty caches and a new control process; a
pool whose run failed is shut down, never reused.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.peers.eval_policies import Policy, default_transfer_mode

Pool = Any  # an AsyncLMPool (imported lazily: the suite's parser loads without torch)


def reset_options(policy: Policy, kv_events=None) -> dict:
    """What a kept pool's reset sets for ``policy`` (and ``kv_events``, which an external router
    reads): every setting a reset may change, so nothing of the run before it carries over."""
    from lmpool.config import RoutingConfig

    mode = policy.transfer_mode if policy.transfer_mode is not None else default_transfer_mode()
    return {"routing": policy.routing, "routing_config": RoutingConfig(**dict(policy.routing_config)),
            "transfer_mode": mode, "kv_events": kv_events}


def worker_key(policy: Policy, kv_blocks: int) -> tuple:
    """What a policy's workers are set up by (``lmpool.config.pool.reset_config`` keeps these):
    runs of one key share a kept pool."""
    from lmpool.config import RoutingConfig
    from lmpool.config.pool import TransferConfig

    options = reset_options(policy)
    groups = RoutingConfig(**dict(policy.routing_config)).cascade_groups
    foreground = TransferConfig(transfer_mode=options["transfer_mode"]).foreground_release
    return kv_blocks, groups, foreground


class PoolKeeper:
    """``make(policy, setting, kv_events)`` builds an unstarted pool; ``warm_up(pool, trace,
    setting)`` replays a trace on it, unmeasured. With ``keep`` off, every run gets a pool of its own."""

    def __init__(self, make: Callable[..., Pool], warm_up: Callable[[Pool, Any, Any], Awaitable[object]],
                 keep: bool) -> None:
        self.make, self.warm_up, self.keep = make, warm_up, keep
        self.pool: Pool | None = None
        self.key: tuple | None = None

    async def acquire(self, policy: Policy, setting, trace, kv_events=None) -> tuple[Pool, dict]:
        """A pool for one run of ``policy`` (publishing ``kv_events`` where given), and what getting
        it cost (``start_s``; ``reset_s`` and ``pool_reused`` for a kept one; ``warm_up_s`` for a
        kept one's first run)."""
        key = worker_key(policy, setting.kv_blocks)
        options = reset_options(policy, kv_events)
        if self.keep and self.pool is not None and key == self.key:
            started = time.perf_counter()
            try:
                await self.pool.reset(**options)
            except (TypeError, ValueError):
                raise  # settings the reset refused: the pool is as it was
            except BaseException:
                await self.close()  # a failed reset (its settings restored, or not) starts the next run afresh
                raise
            return self.pool, {"pool_reused": True, "reset_s": time.perf_counter() - started}
        await self.close()
        pool = self.make(policy, setting, kv_events)
        started = time.perf_counter()
        try:
            await pool.start()
            record = {"start_s": time.perf_counter() - started}
            if self.keep:
                started = time.perf_counter()
                await self.warm_up(pool, trace, setting)
                await pool.reset(**options)
                record["warm_up_s"] = time.perf_counter() - started
        except BaseException:
            await pool.shutdown()
            raise
        self.pool, self.key = pool, key
        return pool, record

    async def release(self, failed: bool = False) -> None:
        """The run is over: a pool of its own (or one whose run failed) is shut down."""
        if failed or not self.keep:
            await self.close()

    async def close(self) -> None:
        pool, self.pool, self.key = self.pool, None, None
        if pool is not None:
            await pool.shutdown()
