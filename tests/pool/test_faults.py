"""Killing a worker or the control process mid-run, or stopping one (hung: alive but silent),
loses no request and changes no token."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
import uvloop
from pool_waits import settled
from stream_testkit import stream_all

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool

BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
N = 200


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    stems = [torch.randint(0, 1000, (48,), generator=g).tolist() for _ in range(8)]
    return [stems[i % 8] + torch.randint(0, 1000, (i % 13 + 1,), generator=g).tolist() for i in range(N)]


# One long request pinned to the victim rank: it cannot finish there before the fault (its
# decode outlasts the run's first tokens by a thousand steps), so it must finish elsewhere. The
# short ones may finish on the victim first, from outputs it wrote before the fault.
LONG_PROMPT = list(range(3, 40))
LONG = SamplingParams(temperature=0, max_tokens=1200, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.fixture(scope="module")
def long_reference(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return llm.generate([LONG_PROMPT], LONG)[0].token_ids


async def run_with_kill(pool: AsyncLMPool, victim_pid, sig: int = signal.SIGKILL) -> list:
    """Start all requests; once 20 tokens have streamed, send ``sig`` to ``victim_pid()``."""
    return await stream_all(pool, prompts(), PARAMS, 20, lambda: os.kill(victim_pid(), sig))


async def run_with_worker_fault(pool: AsyncLMPool, victim: int, sig: int) -> tuple[list, object]:
    """``run_with_kill`` on worker ``victim``, beside the long request pinned to it: every short
    request's last output, and the long one's."""
    long = pool.generate(LONG_PROMPT, LONG, rank=victim)
    return await asyncio.gather(run_with_kill(pool, lambda: pool.client.ranks[victim].proc.pid, sig), long)


async def wait_for_resync(pool: AsyncLMPool) -> dict:
    """Poll the pool's stats until every live rank's snapshot has reached the control plane."""
    return await settled(pool, lambda stats: all(r["snapshot_version"] > 0 for r in stats["ranks"] if r["alive"]),
                         "the resync: every live rank's snapshot at the control plane", limit=60)


def test_worker_sigkill_mid_run(tiny_model, reference, long_reference):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK) as pool:
            outs, long = await run_with_worker_fault(pool, 1, signal.SIGKILL)
            stats = await pool.stats()
            again = await pool.generate(prompts()[0], PARAMS)
            return outs, long, stats, again

    outs, long, stats, again = uvloop.run(main())
    assert [o.token_ids for o in outs] == reference and long.token_ids == long_reference
    assert not stats["ranks"][1]["alive"]
    assert long.rank != 1, "the dead rank's unfinished request finishes on a live rank"
    assert again.rank != 1 and again.num_cached_tokens > 0


def test_control_sigkill_mid_run(tiny_model, reference):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK) as pool:
            old = pool.client.control_proc.pid
            outs = await run_with_kill(pool, lambda: pool.client.control_proc.pid)
            stats = await wait_for_resync(pool)
            # After the resync, routing finds the prefixes again: a repeat of an early
            # prompt goes to a rank that holds its blocks and hits the cache.
            again = await pool.generate(prompts()[5], PARAMS)
            return outs, stats, again, old

    outs, stats, again, old = uvloop.run(main())
    assert [o.token_ids for o in outs] == reference
    assert stats["control_pid"] != old and stats["control_restarts"] >= 1
    assert all(r["alive"] for r in stats["ranks"])
    assert again.num_cached_tokens >= 48


HANG_TIMEOUT = 10.0  # far above a tiny-model step on CPU (milliseconds), even on a loaded machine
GUARD_S = 120.0  # a pool that never notices the hang fails here instead of hanging the suite


def test_a_stopped_worker_is_taken_for_hung_killed_and_its_requests_finish_elsewhere(
    tiny_model, reference, long_reference
):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK, hang_timeout=HANG_TIMEOUT) as pool:
            victim = pool.client.ranks[1].proc
            async with asyncio.timeout(GUARD_S):
                outs, long = await run_with_worker_fault(pool, 1, signal.SIGSTOP)
                stats = await pool.stats()
            return outs, long, stats, victim.poll()

    outs, long, stats, exit_code = uvloop.run(main())
    assert [o.token_ids for o in outs] == reference and long.token_ids == long_reference
    assert not stats["ranks"][1]["alive"] and long.rank != 1
    assert exit_code == -signal.SIGKILL  # killed, not left stopped behind the pool


def test_a_stopped_control_process_is_replaced(tiny_model, reference):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, hang_timeout=HANG_TIMEOUT) as pool:
            old = pool.client.control_proc
            async with asyncio.timeout(GUARD_S):
                outs = await run_with_kill(pool, lambda: old.pid, signal.SIGSTOP)
                again = await pool.generate(prompts()[3], PARAMS)  # routes through the new control process
                stats = await pool.stats()
            return outs, again, stats, old.poll()

    outs, again, stats, exit_code = uvloop.run(main())
    assert [o.token_ids for o in outs] == reference
    assert again.token_ids == reference[3]
    assert stats["control_restarts"] >= 1 and exit_code == -signal.SIGKILL


def test_a_request_that_loses_a_second_rank_fails_and_the_pool_serves_on(tiny_model):
    """Recomputed once after its rank dies; if the rank it moved to dies too, the request fails
    (it might be what kills them) instead of moving on to the last rank."""
    from lmpool.frontend.client import PoolError

    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK) as pool:
            engine = pool.client
            stream = pool.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
            killed: list[int] = []
            with pytest.raises(PoolError, match="was running on 2 ranks that died"):
                async with asyncio.timeout(GUARD_S):
                    async for out in stream:
                        rank = engine.requests[out.request_id].rank
                        if rank not in killed:  # a token from a rank it has not lost yet
                            killed.append(rank)
                            os.kill(engine.ranks[rank].proc.pid, signal.SIGKILL)
            survivor = await pool.generate([4, 5, 6], PARAMS)
            return killed, survivor

    killed, survivor = uvloop.run(main())
    assert len(killed) == 2 and survivor.rank not in killed


def test_with_every_rank_dead_a_request_is_told_so(tiny_model):
    from lmpool.frontend.client import PoolError

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            for rank in pool.client.ranks:
                os.kill(rank.proc.pid, signal.SIGKILL)
            # Before the pool noticed, the request may be sent to a dead rank, rerouted to the
            # other, and fail there; once it has noticed, nothing is sent.
            with pytest.raises(PoolError, match="no rank is alive|ranks that died"):
                async with asyncio.timeout(GUARD_S):
                    await pool.generate([1, 2, 3], PARAMS)
            with pytest.raises(PoolError, match="no rank is alive"):
                await pool.generate([1, 2, 3], PARAMS)

    uvloop.run(main())
