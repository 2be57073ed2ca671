"""KV transfers between two CUDA replicas (**GPU**): on one GPU (or two that can address
each other) the destination pulls the blocks out of the source's cache through CUDA IPC;
with ``gpu_transfer_path="nccl"`` on two GPUs they are packed over NCCL (**NCCL**). A copy
and a move are byte-equal to the source (SHA-256 of every layer's KV), a copy keeps and a
move frees the source, and generation on the destination starts from the transferred
prefix with the tokens that recomputing it gives."""

from __future__ import annotations

import asyncio

import pytest
import torch
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 16
BLOCKS = 64  # per replica: both share cuda:0
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(seed: int, blocks: int = 3) -> list[int]:
    return torch.randint(0, 1000, (blocks * BLOCK + 5,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype, use_kernels", [("float32", True), ("bfloat16", True), ("float32", False)],
                         ids=["fp32-kernel", "bf16-kernel", "fp32-reference"])
def test_copy_and_move_between_replicas_on_one_gpu(tiny_model, dtype, use_kernels):
    engine_args = dict(device="cuda", dtype=dtype, block_size=BLOCK, num_kv_blocks=BLOCKS, use_kernels=use_kernels)
    with LLM(tiny_model, **engine_args) as llm:  # recomputation, for the tokens to compare with
        expected = [llm.generate(prompt(s), GREEDY)[0].token_ids for s in (1, 2)]

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, enable_transfers=True, **engine_args) as pool:
            engine = pool.client
            firsts = [await pool.generate(prompt(s), GREEDY, rank=0) for s in (1, 2)]
            sources = [await engine.block_digests(0, prompt(s)) for s in (1, 2)]
            assert all(all(d) for d in sources)
            assert await engine.block_digests(1, prompt(1)) == ["", "", ""]

            copied = await pool.transfer(prompt(1), src=0, dst=1)
            assert copied.state == "done", copied.reason
            assert await engine.block_digests(1, prompt(1)) == sources[0], "the copy is byte-equal"
            assert await engine.block_digests(0, prompt(1)) == sources[0], "a copy keeps the source"
            on_copy = await pool.generate(prompt(1), GREEDY, rank=1)
            on_source = await pool.generate(prompt(1), GREEDY, rank=0)  # same cached-prefix path there

            moved = await pool.transfer(prompt(2), src=0, dst=1, move=True)
            assert moved.state == "done", moved.reason
            assert await engine.block_digests(1, prompt(2)) == sources[1], "the move is byte-equal"
            assert await engine.block_digests(0, prompt(2)) == ["", "", ""], "a move frees the source"
            on_move = await pool.generate(prompt(2), GREEDY, rank=1)

            back = await pool.transfer(prompt(2), src=1, dst=0)  # the other direction
            assert back.state == "done", back.reason
            assert await engine.block_digests(0, prompt(2)) == sources[1]
            stale = await pool.transfer(prompt(2), src=0, dst=1)  # rank 1 already holds it
            for _ in range(400):  # loads reach the engine with the workers' next reports
                stats = await pool.stats()
                if all(r["blocks_used"] == 0 for r in stats["ranks"]):
                    break
                await asyncio.sleep(0.02)
            return firsts, on_copy, on_source, on_move, stale, stats

    firsts, on_copy, on_source, on_move, stale, stats = uvloop.run(main())
    assert [f.num_cached_tokens for f in firsts] == [0, 0]
    assert on_copy.num_cached_tokens == on_move.num_cached_tokens == on_source.num_cached_tokens == 3 * BLOCK
    assert on_copy.token_ids == on_source.token_ids, "the same bytes give the same tokens"
    if dtype == "float32":  # bf16 rounds differently with and without a cached prefix
        assert [on_copy.token_ids, on_move.token_ids] == expected
        assert [f.token_ids for f in firsts] == expected
    assert stale.state == "aborted"
    assert all(r["alive"] for r in stats["ranks"])
    assert all(r["blocks_used"] == 0 for r in stats["ranks"]), "no plan kept a pin or a reservation"


def test_a_copy_out_of_a_rank_that_is_stepping_is_byte_equal_and_its_requests_go_on(tiny_model):
    """Workers serve plan orders while a step runs: a copy from a rank decoding a batch lands
    byte-equal, and that batch's tokens are those the rank gives alone."""
    engine_args = dict(device="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS)
    long = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    busy = [prompt(20 + i, blocks=1) for i in range(3)]
    with LLM(tiny_model, **engine_args) as llm:
        expected = [out.token_ids for out in llm.generate(busy, long)]

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, enable_transfers=True, **engine_args) as pool:
            await pool.generate(prompt(1), GREEDY, rank=0)
            source = await pool.client.block_digests(0, prompt(1))
            streams = [pool.stream(p, long, rank=0) for p in busy]
            for s in streams:  # each has its first token: rank 0 is decoding all three
                await anext(s)

            async def rest(s):
                last = None
                async for last in s:
                    pass
                return last

            decoding = [asyncio.create_task(rest(s)) for s in streams]
            copied = await pool.transfer(prompt(1), src=0, dst=1)
            landed = await pool.client.block_digests(1, prompt(1))
            outs = await asyncio.gather(*decoding)
            return source, copied, landed, [o.token_ids for o in outs]

    source, copied, landed, tokens = uvloop.run(main())
    assert copied.state == "done", copied.reason
    assert all(source) and landed == source
    assert tokens == expected


def test_transfer_of_many_blocks_and_of_one(tiny_model):
    """Sizes at both ends of the curve: one block, and a chain the length of a long prompt."""
    engine_args = dict(device="cuda", dtype="bfloat16", block_size=BLOCK, num_kv_blocks=BLOCKS)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, enable_transfers=True, **engine_args) as pool:
            results = []
            for seed, blocks in ((3, 1), (4, 40)):
                p = prompt(seed, blocks)
                await pool.generate(p, SamplingParams(temperature=0, max_tokens=1), rank=0)
                source = await pool.client.block_digests(0, p)
                result = await pool.transfer(p, src=0, dst=1, move=True)
                results.append((result, source, await pool.client.block_digests(1, p), blocks))
            return results

    for result, source, copied, blocks in uvloop.run(main()):
        assert result.state == "done", result.reason
        assert len(source) == blocks and all(source)
        assert copied == source


@pytest.mark.nccl
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_copy_and_move_over_nccl_between_two_gpus(tiny_model):
    """The packed path inside a pool: replicas on cuda:0 and cuda:1 told to use NCCL even
    though the GPUs could pull from each other."""
    engine_args = dict(device="cuda", dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS)
    with LLM(tiny_model, **engine_args) as llm:
        expected = llm.generate(prompt(5, 12), GREEDY)[0].token_ids

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, enable_transfers=True, gpu_transfer_path="nccl",
                               **engine_args) as pool:
            engine = pool.client
            p, q = prompt(5, 12), prompt(6, 12)
            for x in (p, q):
                await pool.generate(x, GREEDY, rank=0)
            sources = [await engine.block_digests(0, x) for x in (p, q)]
            copied = await pool.transfer(p, src=0, dst=1)
            moved = await pool.transfer(q, src=0, dst=1, move=True)
            back = await pool.transfer(q, src=1, dst=0)  # the other direction
            digests = [await engine.block_digests(r, x) for r, x in ((1, p), (0, p), (1, q), (0, q))]
            on_copy = await pool.generate(p, GREEDY, rank=1)
            return sources, [copied, moved, back], digests, on_copy

    sources, results, digests, on_copy = uvloop.run(main())
    assert [r.state for r in results] == ["done"] * 3, [r.reason for r in results]
    assert all(all(d) for d in sources)
    assert digests == [sources[0], sources[0], sources[1], sources[1]], "byte-equal, the copy's source kept"
    assert on_copy.num_cached_tokens == 12 * BLOCK and on_copy.token_ids == expected
