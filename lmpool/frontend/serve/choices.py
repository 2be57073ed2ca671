"""The pool requests one OpenAI request becomes: ``n`` choices for each of its prompts.

Each choice is a request of its own, submitted through the pool like any other (so ``n``
choices of one prompt share its cached prefix wherever routing puts them; nothing forks a
sequence inside an engine). Choice ``j`` of prompt ``p`` has index ``p * n + j`` (vLLM's order);
with a ``seed``, choice ``j`` samples with ``seed + j``, as vLLM's, so that seeded choices differ
and the request stays reproducible. A request's choices all succeed or all end: the first
failure (bad input: a 400) or a client that leaves cancels the others, which aborts them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass

from lmpool.frontend.serve.responses import Choice
from lmpool.outputs import RequestOutput
from lmpool.sampling_params import SamplingParams


@dataclass(frozen=True)
class Run:
    """One choice and the pool request that answers it."""

    choice: Choice
    prompt_ids: list[int]
    params: SamplingParams


def plan(prompts: list[list[int]], params: SamplingParams, n: int, echoes: list[str] | None = None,
         prompt_only: bool = False) -> list[Run]:
    """The runs of ``n`` choices for each prompt; ``echoes``: each prompt's text, to show first."""
    runs = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            child = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            choice = Choice(p * n + j, first_of_prompt=j == 0, echo=echoes[p] if echoes else None,
                            prompt_only=prompt_only)
            runs.append(Run(choice, ids, child))
    return runs


def request_ids(request_id: str, runs: list[Run]) -> list[str]:
    return [request_id] if len(runs) == 1 else [f"{request_id}-{i}" for i in range(len(runs))]


async def generate_all(pool, runs: list[Run], request_id: str) -> list[RequestOutput]:
    """Every run's final output."""
    rids = request_ids(request_id, runs)
    return await first_failure([pool.generate(r.prompt_ids, r.params, request_id=rid) for r, rid in zip(runs, rids)])


async def start_streams(pool, runs: list[Run], request_id: str
                        ) -> tuple[list[RequestOutput], list[AsyncGenerator[RequestOutput, None]]]:
    """Every run's stream and its first output, awaited so that a request the pool refuses gets
    its status code rather than a 200 stream holding an error; on any failure every stream ends."""
    streams = [pool.stream(r.prompt_ids, r.params, request_id=rid)
               for r, rid in zip(runs, request_ids(request_id, runs))]
    try:
        firsts = await first_failure([anext(stream) for stream in streams])
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return firsts, streams


async def first_failure(awaitables: list[Awaitable]) -> list:
    """Their results, in order; the first failure cancels the rest and is raised as itself."""
    tasks = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_awaited(a)) for a in awaitables]
    except BaseExceptionGroup as failures:
        raise _first_leaf(failures) from None
    return [task.result() for task in tasks]


async def _awaited(awaitable: Awaitable):
    return await awaitable


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
