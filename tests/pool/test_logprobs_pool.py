"""Logprobs and penalties through a pool of CPU replicas equal one engine's: a request's token and
prompt logprobs, and penalized tokens, however routing places them, and also for a request whose
rank is killed mid-stream (recomputed on another: its logprobs stay one per token, its prompt's
are shown once)."""

from __future__ import annotations

import asyncio
import os
import signal

import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool

BLOCK = 16
TOLERANCE = 5e-4  # recomputed on another rank: its outputs run as prefill, not decode steps
PROMPT = list(range(3, 40))
ASKED = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, logprobs=2, prompt_logprobs=1)
PENALIZED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2)


def same_logprobs(got: list, expected: list) -> bool:
    return len(got) == len(expected) and all(
        (g is None and e is None) or (g.token_id == e.token_id and abs(g.logprob - e.logprob) < TOLERANCE
                                      and same_top(g, e)) for g, e in zip(got, expected))


def same_top(got, expected) -> bool:
    """The same alternatives, in the same order where the expected ones are told apart by more than
    the tolerance (a recomputation may swap two near-tied ones), within the tolerance."""
    values = expected.top_logprobs
    if any(abs(a - b) >= TOLERANCE for a, b in zip(sorted(got.top_logprobs), sorted(values))):
        return False
    distinct = next((i for i in range(len(values) - 1) if values[i] - values[i + 1] < 2 * TOLERANCE), len(values))
    return got.top_ids[:distinct] == expected.top_ids[:distinct]


def test_logprobs_and_penalties_survive_a_rank_s_death(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected, penalized = llm.generate([PROMPT, PROMPT[:20]], [ASKED, PENALIZED])

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            # A thousand tokens pinned to rank 0: it cannot finish there before the kill, after its first.
            stream = pool.stream(PROMPT, ASKED, rank=0)
            first = await anext(stream)
            os.kill(pool.client.ranks[0].proc.pid, signal.SIGKILL)
            last = first
            async for last in stream:
                pass
            return first, last, await pool.generate(PROMPT[:20], PENALIZED)

    first, last, pool_penalized = uvloop.run(main())
    assert first.rank == 0 and last.rank == 1
    assert last.token_ids == expected.token_ids and len(last.logprobs) == 1000
    assert same_logprobs(last.logprobs, expected.logprobs)
    assert same_logprobs(last.prompt_logprobs, expected.prompt_logprobs)
    assert first.prompt_logprobs == last.prompt_logprobs  # shown with the first token, kept from rank 0's
    assert pool_penalized.token_ids == penalized.token_ids


def test_prompt_logprobs_too_many_for_one_message_together_go_in_several(tiny_model):
    """Requests whose prompt logprobs each fit a message (ingress checks each alone) but not
    together finish their prompts in one step (the first may take a step alone, the seven
    after it arrive while it runs: 1.8 MB of logprobs): the worker sends them apart and serves on."""
    prompts = [[(7 * i + j) % 1000 + 1 for i in range(1000)] for j in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=1, block_size=BLOCK, max_num_batched_tokens=8192) as pool:
            outs = await asyncio.gather(*(pool.generate(p, params) for p in prompts))
            return outs, await pool.generate(PROMPT, PENALIZED)

    outs, after = uvloop.run(main())
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
        assert all(len(e.top_ids) == 20 for e in out.prompt_logprobs[1:])
    assert len(after.token_ids) == PENALIZED.max_tokens  # the rank served on
