"""A pool's ``reset``: every rank forgets its cached prefixes and the control process is
replaced (optionally with another routing rule or transfer mode), so the pool serves as a
freshly started one without starting its workers again; only an idle pool resets."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
import uvloop

from lmpool import SamplingParams
from lmpool.config.routing import RoutingConfig
from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend import launcher as process
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


def shm_descriptors(pid: int) -> int:
    """Open descriptors of process ``pid`` on POSIX shared memory (rings, board, semaphores' memory)."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("/dev/shm/"))


def test_workers_close_each_replaced_control_link(tiny_model):
    """Every reset replaces the control process and its links: a worker closes its end of the old
    one (the rings unmapped, the descriptors freed), or a pool reset between runs would run out."""
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none") as pool:
            workers = pool.client.pids()[:2]
            await pool.reset()
            once = [shm_descriptors(pid) for pid in workers]
            for _ in range(4):
                await pool.reset()
                await pool.generate(PROMPT, GREEDY)
            assert [shm_descriptors(pid) for pid in workers] == once

    uvloop.run(main())


def test_a_reset_whose_control_process_fails_keeps_the_previous_settings(tiny_model):
    pytest.importorskip("zmq")

    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
            async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none") as pool:
                with pytest.raises(PoolError, match="keeps its previous settings"):
                    await pool.reset(routing="round_robin", kv_events={"endpoint": endpoint})
                assert pool.config.kv_events is None and pool.config.routing == "lmpool"
                out = await pool.generate(PROMPT, GREEDY)
                assert out.route.split()[0] != "round_robin"  # routed by the rule before the reset
                assert (await pool.stats())["control_restarts"] == 0

    uvloop.run(main())


def test_a_cancelled_reset_still_ends_with_the_new_settings(tiny_model):
    """A caller cancelled (a timeout) leaves the reset to finish: never a quiesced old control
    process, nor settings that differ from the ones the pool runs with."""
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none",
                               enable_transfers=True) as pool:
            await pool.generate(PROMPT, GREEDY, rank=0)
            await settled(pool, lambda st: rows(st)[0]["cached_blocks"] > 0, "the prompt cached on rank 0")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.reset(routing="round_robin"), 0.001)
            out = await pool.generate(PROMPT, GREEDY)  # waits for the reset
            assert pool.config.routing == "round_robin" and out.route.split()[0] == "round_robin"
            assert out.num_cached_tokens == 0
            await settled(pool, lambda st: rows(st)[out.rank]["cached_blocks"] > 0, "the prompt cached again")
            await pool.transfer(PROMPT, out.rank, 1 - out.rank)  # transfers start: not quiesced

    uvloop.run(main())


def test_overlapping_resets_replace_the_control_process_with_no_request_on_a_rank(tiny_model):
    """A request submitted while two resets are pending waits for both: neither replaces the
    control process (and resets the workers' caches) with a request on a rank."""
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none") as pool:
            client = pool.client
            replace = client._replace_control
            dispatched_at_replace: list[bool] = []

            async def spy(reset: bool = False) -> None:
                await replace(reset=reset)  # no request may reach a rank before the replacement ends
                dispatched_at_replace.append(any(r.dispatched for r in client.requests.values()))

            client._replace_control = spy
            await pool.generate(PROMPT, GREEDY)
            first = asyncio.create_task(pool.reset())
            second = asyncio.create_task(pool.reset())
            await asyncio.sleep(0)
            out = asyncio.create_task(pool.generate(PROMPT, GREEDY))
            await asyncio.gather(first, second)
            assert (await out).num_cached_tokens == 0
            assert dispatched_at_replace == [False, False]

    uvloop.run(main())


def test_a_shutdown_during_a_reset_stops_the_control_process_it_started(tiny_model):
    async def main():
        pool = AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="none")
        await pool.start()
        spawned = []
        spawn = process.spawn

        def spy(*args, **kwargs):
            spawned.append(spawn(*args, **kwargs))
            return spawned[-1]

        process.spawn = spy
        try:
            reset = asyncio.create_task(pool.reset())
            await asyncio.sleep(0)
            await pool.shutdown()
        finally:
            process.spawn = spawn
        with pytest.raises(PoolError, match="shut down"):
            await reset
        assert all(p.poll() is not None for p in [*spawned, pool.client.control_proc])

    uvloop.run(main())
