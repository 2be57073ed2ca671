"""A worker times its step loop's synchronous stages and the garbage collector's passes
(``worker.loop_stages``), the stretches its readers wait through, and the pool's stats show them
per rank."""

from __future__ import annotations

import gc

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from lmpool import AsyncLMPool, SamplingParams
from lmpool.worker.loop_stages import STAGES, LoopStages
from tests.pool.pool_waits import settled


@given(st.lists(st.tuples(st.sampled_from(STAGES), st.floats(0, 5, allow_nan=False))))
def test_each_stretch_counts_once_under_its_stage(stretches):
    stages = LoopStages()
    for i, (stage, seconds) in enumerate(stretches, 1):
        stages.add(stage, seconds)
        snap = stages.snapshot()
        assert sum(count for count, _, _ in snap.values()) == i
        for s in STAGES:
            mine = [x for name, x in stretches[:i] if name == s]
            count, total, longest = snap[s]
            assert count == len(mine)
            assert total == pytest.approx(sum(mine) * 1e3, abs=1e-3 * max(1, count))
            assert longest == round(max(mine, default=0.0) * 1e3, 3) <= total + 1e-3
            assert count or total == 0


def test_watched_collections_count_until_the_watch_stops():
    stages = LoopStages()
    stop = stages.watch_collections()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        stop()
    count, total, longest = stages.snapshot()["collect"]
    assert count == 2 and 0 <= longest <= total
    gc.collect()
    assert stages.snapshot()["collect"][0] == 2, "a stopped watch counts nothing"


def test_an_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="unknown loop stage 'nap'"):
        LoopStages().add("nap", 0.1)


def test_a_pool_s_stats_show_each_rank_s_loop_stages(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=8) as pool:
            outs = [await pool.generate(list(range(1, 20)), SamplingParams(max_tokens=3), rank=r) for r in (0, 1)]
            stats = await settled(
                pool, lambda s: all(r["loop_ms"] and r["loop_ms"]["read_back"][0] >= 1 for r in s["ranks"]),
                "every rank reported a step it read back")
            return outs, stats

    outs, stats = uvloop.run(main())
    assert [o.rank for o in outs] == [0, 1]
    for rank in stats["ranks"]:
        assert set(rank["loop_ms"]) == set(STAGES)
        for count, total, longest in rank["loop_ms"].values():
            assert 0 <= longest <= total and (count or total == 0)
        assert rank["loop_ms"]["admit"][0] >= 1 and rank["loop_ms"]["launch"][0] >= 1
