"""KV transfers between CPU replicas of a running pool (gloo): the destination's blocks are
byte-equal to the source's, and generation there uses them with the same tokens."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend.client import PoolError
from pool_waits import settled

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt() -> list[int]:
    return torch.randint(0, 1000, (3 * BLOCK + 5,), generator=torch.Generator().manual_seed(11)).tolist()


def test_copy_and_move_between_replicas(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected = llm.generate(prompt(), GREEDY)[0].token_ids

    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK, enable_transfers=True) as pool:
            engine = pool.client
            first = await pool.generate(prompt(), GREEDY, rank=0)
            source = await engine.block_digests(0, prompt())
            assert all(source) and await engine.block_digests(1, prompt()) == ["", "", ""]

            copied = await pool.transfer(prompt(), src=0, dst=1)
            assert copied.state == "done", copied.reason
            assert await engine.block_digests(1, prompt()) == source, "the copy is byte-equal"
            assert await engine.block_digests(0, prompt()) == source, "a copy keeps the source"
            on_copy = await pool.generate(prompt(), GREEDY, rank=1)

            moved = await pool.transfer(prompt(), src=1, dst=2, move=True)
            assert moved.state == "done", moved.reason
            assert await engine.block_digests(2, prompt()) == source
            assert await engine.block_digests(1, prompt()) == ["", "", ""], "a move frees the source"
            on_move = await pool.generate(prompt(), GREEDY, rank=2)

            again = await pool.transfer(prompt(), src=1, dst=0)  # rank 1 no longer holds it
            with pytest.raises(PoolError, match="needs two ranks"):
                await pool.transfer(prompt(), src=2, dst=2)
            return first, on_copy, on_move, again, await pool.stats()

    first, on_copy, on_move, again, stats = uvloop.run(main())
    assert first.token_ids == on_copy.token_ids == on_move.token_ids == expected
    assert first.num_cached_tokens == 0
    assert on_copy.num_cached_tokens == on_move.num_cached_tokens == 3 * BLOCK
    assert again.state == "aborted" and "does not hold" in again.reason
    assert all(r["alive"] for r in stats["ranks"])


def test_destination_killed_mid_plan_aborts_and_releases_the_source(tiny_model):
    """The destination is frozen (SIGSTOP) so the plan cannot pass prepare, then SIGKILLed:
    the plan aborts, the source's pins are released and its copy kept, and the pool goes on
    transferring between the live ranks."""
    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK, enable_transfers=True) as pool:
            engine = pool.client
            await pool.generate(prompt(), GREEDY, rank=0)
            source = await engine.block_digests(0, prompt())
            victim = engine.ranks[1].proc.pid
            os.kill(victim, signal.SIGSTOP)
            plan = asyncio.create_task(pool.transfer(prompt(), src=0, dst=1))
            # The plan is under way once the source has pinned the chain (its used blocks show it).
            await settled(pool, lambda s: s["ranks"][0]["blocks_used"] > 0, "the source pinning the chain")
            os.kill(victim, signal.SIGKILL)
            result = await plan
            after = await engine.block_digests(0, prompt())
            retry = await pool.transfer(prompt(), src=0, dst=2)
            out = await pool.generate(prompt(), GREEDY, rank=2)
            stats = await pool.stats()
            return result, source, after, retry, out, stats

    result, source, after, retry, out, stats = uvloop.run(main())
    assert result.state == "aborted" and "rank 1 died" in result.reason
    assert after == source, "an abort keeps the source's blocks"
    assert retry.state == "done" and out.num_cached_tokens == 3 * BLOCK
    assert stats["ranks"][0]["blocks_used"] == 0, "no pin outlived the aborted plan"


def test_control_killed_mid_plan_the_retry_completes_and_leases_free_the_old_pins(tiny_model):
    """The control process dies while a plan waits on a frozen destination: the engine restarts
    it and retries the transfer under a fresh plan id, which completes once the destination
    runs again; the dead plan's pins on the source end with the workers' lease."""
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, enable_transfers=True,
                               transfer_lease_s=1.0) as pool:
            engine = pool.client
            await pool.generate(prompt(), GREEDY, rank=0)
            source = await engine.block_digests(0, prompt())
            frozen = engine.ranks[1].proc.pid
            os.kill(frozen, signal.SIGSTOP)
            plan = asyncio.create_task(pool.transfer(prompt(), src=0, dst=1))
            # Under way once the source has pinned the chain.
            await settled(pool, lambda s: s["ranks"][0]["blocks_used"] > 0, "the source pinning the chain")
            old_control = engine.control_proc.pid
            os.kill(old_control, signal.SIGKILL)
            os.kill(frozen, signal.SIGCONT)
            result = await plan
            # The old plan's pins end with the lease (1 s here).
            await settled(pool, lambda s: s["ranks"][0]["blocks_used"] == 0, "the release of the dead plan's pins")
            return result, source, await engine.block_digests(1, prompt()), engine.control_proc.pid, old_control

    result, source, copied, control, old_control = uvloop.run(main())
    assert control != old_control
    assert result.state == "done", result.reason
    assert copied == source
