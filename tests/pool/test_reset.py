"""A pool's ``reset``: every rank forgets its cached prefixes and the control process is
replaced (optionally with another routing rule or transfer mode), so the pool serves as a
freshly started one without starting its workers again; only an idle pool resets."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from lmpool import SamplingParams
from lmpool.config.routing import RoutingConfig
from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend.client import PoolError
from lmpool_ipc.lifecycle import pool_objects
from tests.pool.pool_waits import settled

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(100, 180))  # five whole blocks


def pool_objects_of(pool) -> list:
    """The pool's shared-memory objects: links, semaphores, its board."""
    return [o for o in pool_objects() if o.parsed.pool_id == pool.client.ipc.pool_id]


def rows(stats: dict) -> list[dict]:
    return [r for r in stats["ranks"] if r["alive"]]


def test_a_reset_pool_forgets_its_prefixes_counts_afresh_and_routes_by_its_new_rule(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="pull") as pool:
            first = await pool.generate(PROMPT, GREEDY)
            await settled(pool, lambda st: sum(r["cached_blocks"] for r in rows(st)) > 0, "the prompt cached")
            again = await pool.generate(PROMPT, GREEDY)
            assert again.num_cached_tokens > 0 and again.rank == first.rank
            before = await pool.stats()
            workers = pool.client.pids()[:2]

            await pool.reset(routing="round_robin", transfer_mode="none")
            after = await pool.stats()
            assert pool.client.pids()[:2] == workers, "the workers keep running"
            assert after["control_pid"] != before["control_pid"] and after["control_restarts"] == 0
            # What each worker's start spent, phase by phase: the reset started none again.
            phases = before["ranks"][0]["start_phases"]
            assert list(phases)[:3] == ["launch", "kernels", "weights"] and all(v >= 0 for v in phases.values())
            assert {"calibration", "worker"} <= set(phases) and after["ranks"][0]["start_phases"] == phases
            assert pool.config.routing == "round_robin" and pool.config.transfer.transfer_mode == "none"
            for row in rows(after):
                assert (row["cached_blocks"], row["prompt_tokens"], row["prefix_hit_tokens"]) == (0, 0, 0)
            # Round robin from its first rank, on caches that hold nothing: each rank computes it.
            outs = [await pool.generate(PROMPT, GREEDY) for _ in range(2)]
            assert sorted(o.rank for o in outs) == [0, 1]
            assert all(o.num_cached_tokens == 0 and o.token_ids == first.token_ids for o in outs)

            objects = len(pool_objects_of(pool))
            await pool.reset(routing="lmpool", transfer_mode="pull")  # and back, transfers on again
            assert len(pool_objects_of(pool)) == objects, "a reset leaves the old control links behind"
            back = await pool.generate(PROMPT, GREEDY)
            assert back.num_cached_tokens == 0 and back.token_ids == first.token_ids

    uvloop.run(main())


def test_a_pool_with_a_request_in_flight_or_an_option_its_workers_read_does_not_reset(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none") as pool:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            first_token = asyncio.Event()

            async def consume():
                async for _ in pool.stream(PROMPT, long, request_id="busy"):
                    first_token.set()

            task = asyncio.create_task(consume())
            await first_token.wait()
            with pytest.raises(PoolError, match="idle"):
                await pool.reset()
            await pool.abort("busy")
            await task
            flipped = RoutingConfig(cascade_groups=not pool.config.routing_config.cascade_groups)
            with pytest.raises(ValueError, match="cascade_groups"):
                await pool.reset(routing_config=flipped)
            with pytest.raises(ValueError, match="started with transfers"):
                await pool.reset(transfer_mode="pull")
            with pytest.raises(TypeError, match="block_size"):
                await pool.reset(block_size=32)
            # The aborted request's prompt is cached, as the control plane sees it.
            seen = await settled(pool, lambda st: sum(r["cached_blocks"] for r in rows(st)) > 0, "the prompt cached")
            assert (await pool.generate(PROMPT, GREEDY)).num_cached_tokens > 0
            await pool.reset()
            assert (await pool.stats())["control_pid"] != seen["control_pid"]
            assert (await pool.generate(PROMPT, GREEDY)).num_cached_tokens == 0
        with pytest.raises(PoolError, match="not running"):
            await pool.reset()

    uvloop.run(main())


def test_a_request_submitted_during_a_reset_waits_for_it_and_meets_the_new_rule(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none") as pool:
            await pool.generate(PROMPT, GREEDY)
            await settled(pool, lambda st: sum(r["cached_blocks"] for r in rows(st)) > 0, "the prompt cached")
            reset = asyncio.create_task(pool.reset(routing="round_robin"))
            await asyncio.sleep(0)  # the reset has begun: it awaits the old control process
            assert not reset.done()
            out = await pool.generate(PROMPT, GREEDY)
            await reset
            return out

    out = uvloop.run(main())
    assert out.route.split()[0] == "round_robin" and out.num_cached_tokens == 0
