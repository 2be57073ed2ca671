"""A pool with more replicas than GPUs, its KV caches sized by default (**GPU**): the replicas
sharing a GPU each take their part of its ``gpu_memory_utilization``, so all of them start,
their caches together stay within that share, and each serves what one engine would."""

from __future__ import annotations

import pytest
import torch
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
UTILIZATION = 0.5  # leaves room for anything else on the GPU, such as another test's pool


def test_replicas_sharing_a_gpu_fit_in_its_share(tiny_model):
    gpus = torch.cuda.device_count()
    world = gpus + 1  # rank 0 and rank ``gpus`` share cuda:0
    prompt = list(range(3, 3 + 2 * BLOCK + 5))
    with LLM(tiny_model, device="cuda", dtype="bfloat16", block_size=BLOCK, num_kv_blocks=16) as llm:
        expected = llm.generate(prompt, GREEDY)[0].token_ids
    async def main():
        async with AsyncLMPool(tiny_model, world_size=world, device="cuda", dtype="bfloat16", block_size=BLOCK,
                               gpu_memory_utilization=UTILIZATION) as pool:
            engine = pool.client
            block_bytes = engine.model_config.kv_bytes_per_block(BLOCK, torch.bfloat16)
            on_first = [r.num_blocks for r in engine.ranks if r.rank % gpus == 0]
            assert len(on_first) == 2 and all(n > 0 for n in on_first)
            total = torch.cuda.get_device_properties(0).total_memory
            assert sum(on_first) * block_bytes <= UTILIZATION * total
            return [await pool.generate(prompt, GREEDY, rank=rank) for rank in (0, gpus)]

    for rank, out in zip((0, gpus), uvloop.run(main())):
        assert out.rank == rank and out.token_ids == expected
