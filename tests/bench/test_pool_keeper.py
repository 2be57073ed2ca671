"""The suite's pool keeper, over fake pools: one pool kept across the runs its workers can serve,
reset before each, warmed up once; a new one where the workers differ; none kept after a reset
that failed part-way, or with ``keep`` off."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.lib.pool_keeper import PoolKeeper
from benchmarks.peers.eval_policies import LMPOOL, LMPOOL_ROUTING, Policy
from benchmarks.replay.eval_driver import Arrival
from benchmarks.replay.eval_settings import Setting

FOREGROUND = Policy("lmpool+foreground", "lmpool", "foreground")
SETTING = Setting(kv_blocks=64, arrival=Arrival())


class FakePool:
    def __init__(self, policy: Policy, log: list) -> None:
        self.policy, self.log, self.fail = policy, log, None

    async def start(self):
        self.log.append(("start", self.policy.name))
        return self

    async def reset(self, **options):
        if self.fail is not None:
            raise self.fail
        self.log.append(("reset", options["routing"], options["transfer_mode"]))

    async def shutdown(self):
        self.log.append(("shutdown", self.policy.name))


def keeper(keep: bool, log: list) -> PoolKeeper:
    async def warm_up(pool, trace, setting):
        log.append(("warm_up", trace))

    return PoolKeeper(lambda policy, setting, kv_events: FakePool(policy, log), warm_up, keep)


def run(coro):
    return asyncio.run(coro)


def test_a_kept_pool_serves_every_run_its_workers_can_and_is_reset_before_each():
    log: list = []
    k = keeper(True, log)

    async def scenario():
        first, started = await k.acquire(LMPOOL, SETTING, "t0")
        await k.release()
        second, reused = await k.acquire(LMPOOL_ROUTING, SETTING, "t1")
        await k.release()
        third, other = await k.acquire(FOREGROUND, SETTING, "t2")  # its workers release through moves
        await k.close()
        return first, second, third, started, reused, other

    first, second, third, started, reused, other = run(scenario())
    assert first is second and third is not first
    assert "start_s" in started and "warm_up_s" in started and "pool_reused" not in started
    assert reused["pool_reused"] and "start_s" not in reused
    assert "start_s" in other
    assert log == [("start", "lmpool"), ("warm_up", "t0"), ("reset", "lmpool", "pull"),
                   ("reset", "lmpool", "none"), ("shutdown", "lmpool"),
                   ("start", "lmpool+foreground"), ("warm_up", "t2"), ("reset", "lmpool", "foreground"),
                   ("shutdown", "lmpool+foreground")]


def test_a_refused_reset_keeps_the_pool_and_a_failed_one_closes_it():
    log: list = []
    k = keeper(True, log)

    async def scenario():
        pool, _ = await k.acquire(LMPOOL, SETTING, "t0")
        pool.fail = ValueError("not this setting")
        with pytest.raises(ValueError):
            await k.acquire(LMPOOL_ROUTING, SETTING, "t1")
        kept = k.pool is pool
        pool.fail = RuntimeError("the control process died")
        with pytest.raises(RuntimeError):
            await k.acquire(LMPOOL_ROUTING, SETTING, "t1")
        return kept, k.pool

    kept, after = run(scenario())
    assert kept and after is None and log[-1] == ("shutdown", "lmpool")


def test_without_keep_every_run_starts_and_stops_a_pool_of_its_own():
    log: list = []
    k = keeper(False, log)

    async def scenario():
        for policy in (LMPOOL, LMPOOL_ROUTING):
            _, record = await k.acquire(policy, SETTING, "t")
            assert "start_s" in record and "warm_up_s" not in record
            await k.release()

    run(scenario())
    assert log == [("start", "lmpool"), ("shutdown", "lmpool"), ("start", "lmpool-routing"),
                   ("shutdown", "lmpool-routing")]
