"""A dead rank shows as dead, with no stale figures (``stats()``, the state board ``lmpool
ps`` and ``top`` read); ranks that die together do not make their requests look like what
kills ranks: those requests are recomputed on the rank left and return the right tokens."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest
from stream_testkit import stream_all
from waiting import until

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool
from lmpool.protocol import LoadReport, RankState
from lmpool.protocol.state_board import LIVE_FIGURES, RankRow

BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(11 * i + j) % 800 + 2 for j in range(24 + i)] for i in range(24)]
LIVE_STATS = ("num_waiting", "num_running", "blocks_free", "blocks_reclaimable", "blocks_used", "cached_blocks")


@pytest.fixture(autouse=True)
def no_leaks(no_leaks):
    yield


def test_a_dead_ranks_row_on_the_board_shows_no_figures():
    load = LoadReport(num_waiting=2, num_running=3, blocks_free=40, blocks_used=7, prompt_tokens=99)
    state = RankState(rank=1, alive=False, epoch=1, snapshot_version=4, heartbeat_age_s=0.1, load=load,
                      cached_blocks=5)
    row = RankRow.from_state(state, pid=1234, blocks_in_flight=2)
    assert all(getattr(row, name) == 0 for name in LIVE_FIGURES)
    assert row.prompt_tokens == 99  # history stays true
    alive = RankRow.from_state(msgspec.structs.replace(state, alive=True), pid=1234, blocks_in_flight=2)
    assert (alive.num_running, alive.blocks_free, alive.cached_blocks) == (3, 40, 5)


def test_stats_show_a_dead_rank_without_its_last_figures(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            await asyncio.gather(*(pool.generate(p, PARAMS, rank=1) for p in PROMPTS[:4]))
            victim = pool.client.ranks[1].proc
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, victim.wait)
            try:  # sent to the dead rank before the pool has seen it die: it finds it gone
                out = await pool.generate(PROMPTS[5], PARAMS, rank=1)
            except ValueError as e:  # the pool saw it die first: the rank is refused by name
                assert "rank 1 is not a live rank" in str(e)
                out = await pool.generate(PROMPTS[5], PARAMS)
            assert out.rank == 0 and len(out.token_ids) == PARAMS.max_tokens
            # The control plane's view, once the death reached it (the user process tells it).
            async def rank_1_dead() -> dict | None:
                row = (await pool.stats())["ranks"][1]
                return None if row["alive"] else row

            dead = await until(rank_1_dead, "rank 1's death to reach the control plane", limit=30, interval=0.02)
            assert {name: dead[name] for name in LIVE_STATS} == dict.fromkeys(LIVE_STATS, 0)

    asyncio.run(main())


def test_requests_of_two_ranks_that_die_together_are_recomputed(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]

    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK, routing="round_robin") as pool:
            victims = [pool.client.ranks[0].proc, pool.client.ranks[1].proc]

            def kill_both():
                for proc in victims:  # together, before the pool sees either die
                    os.kill(proc.pid, signal.SIGKILL)
                for proc in victims:
                    proc.wait()

            outs = await stream_all(pool, PROMPTS, PARAMS, 12, kill_both)
            assert [o.token_ids for o in outs] == reference

    asyncio.run(main())
