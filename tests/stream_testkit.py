"""Streaming every request of a run at once while something happens part-way: the fault tests'
shared driver (kill or stop a process once the run is under way)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def stream_all(pool, prompts, params, after: int, act: Callable[[], None]) -> list:
    """Stream every prompt on ``pool`` at once; once ``after`` tokens have streamed over all of
    them, call ``act()`` (once). Each request's last output, in prompt order; fails if the run
    ended before ``act`` ran."""
    streamed = 0
    acted = asyncio.Event()

    async def one(prompt):
        nonlocal streamed
        last = None
        async for last in pool.stream(prompt, params):
            streamed += 1
            if streamed == after:
                act()
                acted.set()
        return last

    outs = await asyncio.gather(*(one(p) for p in prompts))
    assert acted.is_set(), f"the run ended before {after} tokens streamed"
    return outs
