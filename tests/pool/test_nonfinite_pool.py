"""In a pool, a request whose logits turn NaN fails alone: its stream shows its tokens and then
a ``ValueError`` naming the request and non-finite logits; a request running beside it on the
same rank gets its usual tokens, and the rank serves on with no block held."""

from __future__ import annotations

import asyncio
import os

import pytest
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool
from nonfinite import AFTER, POISON, write_sitecustomize
from pool_waits import settled

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
HEALTHY = list(range(100, 140))
BAD = [POISON, *range(500, 530)]


@pytest.fixture(scope="module")
def expected(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return llm.generate(HEALTHY, GREEDY)[0].token_ids


@pytest.fixture
def poisoned_workers(tmp_path, monkeypatch):
    """The pool's children start with the model poisoned for prompts starting with ``POISON``."""
    write_sitecustomize(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "overlapped"])
def test_a_request_with_non_finite_logits_fails_alone_in_a_pool(tiny_model, expected, poisoned_workers,
                                                                 async_scheduling):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=1, block_size=BLOCK,
                               async_scheduling=async_scheduling) as pool:
            seen = []

            async def bad():
                async for out in pool.stream(BAD, GREEDY, request_id="bad"):
                    seen.append(out.token_ids)

            failed, healthy = await asyncio.gather(bad(), pool.generate(HEALTHY, GREEDY), return_exceptions=True)
            again = await pool.generate(HEALTHY, GREEDY)
            # Reports reach the control plane after the tokens: wait for the rank to show idle.
            stats = await settled(pool, idle, "the rank idle with no block held")
        return seen, failed, healthy, again, stats

    seen, failed, healthy, again, stats = uvloop.run(main())
    assert isinstance(failed, ValueError), failed
    assert "'bad'" in str(failed) and "non-finite logits" in str(failed)
    assert [len(t) for t in seen] == list(range(1, AFTER + 1))  # its tokens, then the error
    assert healthy.token_ids == expected == again.token_ids
    assert stats["ranks"][0]["alive"]


def idle(stats: dict) -> bool:
    rank = stats["ranks"][0]
    return rank["num_running"] == rank["num_waiting"] == rank["blocks_used"] == 0
