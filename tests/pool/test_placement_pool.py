"""Automatic KV transfers in a running CPU pool (gloo): background placement copies a hot
prefix from a loaded rank to its idle partner and a placement lease routes later requests
to the copy; foreground release moves exactly the shortage's worth of cold cached blocks
to the partner instead of evicting them, never the waiting request's own prefix, and falls
back to eviction when the gate refuses. Afterwards nothing is left pinned, reserved or in
flight, and the page table agrees with every worker."""

from __future__ import annotations

import asyncio

import pytest
import torch
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.config.transfer import TransferPolicyConfig
from lmpool.frontend.api import AsyncLMPool
import pool_waits

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
DEADLINE_S = 120.0


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def settled(pool: AsyncLMPool) -> dict:
    """Wait until every rank is idle and has reported it, then check that nothing leaked: no
    plan, in-flight marker or reservation on the control plane, no pinned or reserved block on
    a worker, every block free or cached, and the page table agreeing with each worker."""
    def idle(stats: dict) -> bool:
        t = stats["transfers"]
        return (t["plans_open"] == 0 and t["in_flight_blocks"] == 0 and t["reservations"] == 0
                and all(r["num_running"] == r["num_waiting"] == r["blocks_used"] == 0 for r in stats["ranks"])
                and all(r["cached_blocks"] == r["blocks_reclaimable"] for r in stats["ranks"]))

    stats = await pool_waits.settled(pool, idle, "an idle pool whose page table matches every worker",
                                     limit=DEADLINE_S)
    for r in stats["ranks"]:
        assert r["blocks_free"] + r["blocks_reclaimable"] == pool.client.ranks[r["rank"]].num_blocks, r
    return stats


def test_background_copy_of_a_hot_prefix_draws_later_requests(tiny_model):
    hot = tokens(2 * BLOCK, 1)  # one tick's copy (background_copy_max_blocks=2) carries it whole
    load_prompts = [tokens(40, 100 + i) for i in range(3)]
    asks = [hot + tokens(5, 10 + i) for i in range(3)]
    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected = llm.generate(asks[-1], GREEDY)[0].token_ids

    # Hot after two routed requests (1.5 heat each: an access and a route hit), not after one.
    policy = TransferPolicyConfig(interval_s=0.05, hot_threshold=2.5, min_load_skew_s=0.01, cooldown_s=600,
                                  lease_s=600, prefill_s_per_token=1e-2)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode="background",
                               background_copy_max_blocks=2, transfer_policy=policy) as pool:
            seeded = await pool.generate(hot + tokens(5, 9), GREEDY, rank=0)  # rank 0 caches the prefix
            assert (seeded.rank, seeded.route) == (0, "pinned")
            # Load skew: long decodes on rank 0 only.
            long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
            loads = [asyncio.create_task(pool.generate(p, long, rank=0)) for p in load_prompts]
            await pool_waits.settled(pool, lambda s: s["ranks"][0]["num_running"] == 3, "rank 0 loaded",
                                     limit=DEADLINE_S)
            before = [await pool.generate(a, GREEDY) for a in asks[:2]]  # demand heats the prefix
            copied = await pool_waits.settled(pool, lambda s: s["transfers"]["background_copies"] >= 1,
                                              "a background copy", limit=DEADLINE_S)
            after = await pool.generate(asks[-1], GREEDY)
            stats = await pool.stats()
            for task in loads:
                task.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
            final = await settled(pool)
            digests = [await pool.client.block_digests(r, hot) for r in (0, 1)]
            return before, copied, after, stats, final, digests

    before, copied, after, stats, final, digests = uvloop.run(main())
    assert all(out.rank == 0 for out in before), "the owner keeps the prefix's requests while it is cached alone"
    t = copied["transfers"]
    assert t["blocks_copied"] == 2 and t["blocks_moved"] == 0, "the whole prefix, once: then the chain cools"
    assert t["admission_admitted"] >= 1 and t["plans_committed"] == t["background_copies"] == 1
    assert after.rank == 1 and after.num_cached_tokens == 2 * BLOCK, after
    assert after.token_ids == expected, "tokens on the copy equal recomputation"
    # The copy holds the whole prefix, so routing picks it on its own; the lease (granted, but
    # only needed while a copy is partial) is exercised in tests/control/test_leases.py.
    assert stats["transfers"]["leases"] >= 1
    assert digests[1][:2] == digests[0][:2] and all(digests[0]), "the copy is byte-equal to the source"
    assert final["transfers"]["plans_aborted"] == 0


def test_foreground_moves_the_shortage_instead_of_evicting_and_falls_back_when_refused(tiny_model):
    """16 blocks per rank. A, B and G are each used twice (one reuse per block). C reuses
    A's prefix and needs 7 fresh blocks where 6 are free: a shortage of one. Eviction would
    take A's leaf (least recently used) but A is C's own prefix, so the victim is B's leaf,
    moved with its two ancestors copied along. D then needs 3 fresh blocks where 1 is free:
    its victims, C's own blocks, were never reused, so the gate refuses and D evicts them."""
    a, b, g = tokens(3 * BLOCK, 1), tokens(3 * BLOCK, 2), tokens(4 * BLOCK, 5)
    c = a + tokens(108, 3)
    d = tokens(40, 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected_c, expected_d = (o.token_ids for o in llm.generate([c, d], params))

    policy = TransferPolicyConfig(prefill_s_per_token=1e-2, foreground_wait_s=60.0)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, num_kv_blocks=16,
                               transfer_mode="foreground", transfer_policy=policy) as pool:
            engine = pool.client
            for prompt in (a, a, b, b, g, g):
                await pool.generate(prompt + tokens(5, 7), params, rank=0)
            quiet = await settled(pool)
            a_bytes, b_bytes = await engine.block_digests(0, a), await engine.block_digests(0, b)
            out_c = await pool.generate(c, params, rank=0)
            moved = await settled(pool)
            where = {name: [await engine.block_digests(r, p) for r in (0, 1)] for name, p in (("a", a), ("b", b))}
            out_d = await pool.generate(d, params, rank=0)
            final = await settled(pool)
            return quiet, a_bytes, b_bytes, out_c, moved, where, out_d, final

    quiet, a_bytes, b_bytes, out_c, moved, where, out_d, final = uvloop.run(main())
    assert quiet["transfers"]["foreground_requests"] == 0, "no shortage while the cache had room"
    assert out_c.token_ids == expected_c and out_c.num_cached_tokens == 3 * BLOCK
    t = moved["transfers"]
    assert t["foreground_requests"] == t["foreground_moves"] == 1 and t["foreground_refused"] == 0
    assert t["blocks_moved"] == 1, "only the shortage's worth is moved"
    assert t["blocks_copied"] == 2, "the victim's ancestors are copied along, and kept"
    assert where["b"][1] == b_bytes, "the partner holds B, byte-equal"
    assert where["b"][0] == b_bytes[:2] + [""], "the source gave up the moved block only"
    assert where["a"][0] == a_bytes and where["a"][1] == ["", "", ""], "C's own prefix was never a victim"
    assert out_d.token_ids == expected_d
    f = final["transfers"]
    assert f["foreground_requests"] == 2 and f["foreground_refused"] == 1
    assert f["admission_refused"] == 1 and f["admission_admitted"] == 1, "the gate refused the never-reused blocks"
    assert f["foreground_moves"] == 1 and f["blocks_moved"] == 1 and f["plans_aborted"] == 0
    assert final["ranks"][1]["cached_blocks"] == 3, "nothing more reached the partner"


@pytest.mark.parametrize("mode", ["x", "Background"])
def test_bad_transfer_mode_is_refused_before_anything_starts(tiny_model, mode):
    with pytest.raises(ValueError, match="transfer_mode must be one of none, background, foreground, both"):
        AsyncLMPool(tiny_model, transfer_mode=mode)


def test_a_transfer_profile_for_another_model_is_refused_before_anything_starts(tiny_model, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text('{"model": {"kv_bytes_per_block": 12}, "pairs": {"0->1": {"1": {"p95_s": 0.001}}}}')
    with pytest.raises(ValueError, match="measured for 12 KV bytes per block"):
        AsyncLMPool(tiny_model, transfer_mode="both", transfer_policy=TransferPolicyConfig(transfer_profile=str(profile)))
    with pytest.raises(ValueError, match="cannot be used"):
        AsyncLMPool(tiny_model, transfer_mode="both",
                    transfer_policy=TransferPolicyConfig(transfer_profile=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="hot_threshold must be > 0"):
        AsyncLMPool(tiny_model, transfer_mode="background", transfer_policy=TransferPolicyConfig(hot_threshold=0))
    with pytest.raises(ValueError, match="background_copy_batch_max_blocks"):
        AsyncLMPool(tiny_model, transfer_mode="background", background_copy_max_blocks=16,
                    background_copy_batch_max_blocks=8)
