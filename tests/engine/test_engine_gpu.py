"""The engine on CUDA: same greedy tokens as the CPU path (fp32), CUDA graphs equal eager."""

from __future__ import annotations

import pytest
import torch

from lmpool import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts(n: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in torch.randint(1, 90, (n,), generator=g)]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_gpu_fp32_greedy_equals_cpu(tiny_model, cpu_tokens, enforce_eager):
    with LLM(tiny_model, device="cuda", dtype="float32", block_size=BLOCK, enforce_eager=enforce_eager) as llm:
        assert llm.engine.runner.ops.name == "cuda"
        assert (llm.engine.runner.graphs is None) == enforce_eager
        outs = llm.generate(prompts(), GREEDY)
        again = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == cpu_tokens
    assert [o.token_ids for o in again] == cpu_tokens
    assert any(o.num_cached_tokens > 0 for o in again)


def test_gpu_torch_reference_path_equals_kernels(tiny_model, cpu_tokens):
    with LLM(tiny_model, device="cuda", dtype="float32", block_size=BLOCK, use_kernels=False) as llm:
        assert llm.engine.runner.ops.name == "torch"
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == cpu_tokens


@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_bf16_runs_with_preemption(tiny_model, block_size):
    with LLM(tiny_model, device="cuda", dtype="bfloat16", block_size=block_size, num_kv_blocks=8 if block_size == 16 else 3) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0 or block_size == 256
    assert all(len(o.token_ids) == 32 for o in outs)
    assert len({t for o in outs for t in o.token_ids}) > 32
