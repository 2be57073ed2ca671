"""Waiting for a pool to reach a state: poll its stats until a condition holds or a
deadline passes (a state to reach, never a fixed delay)."""

from __future__ import annotations

import asyncio


async def settled(pool, condition, what: str, limit: float = 30.0) -> dict:
    """The first ``pool.stats()`` for which ``condition`` holds; fails naming ``what`` after ``limit`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        stats = await pool.stats()
        if condition(stats):
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"{what} never happened; last stats: {stats}")
        await asyncio.sleep(0.05)


def no_blocks_held(stats: dict) -> bool:
    """No live rank holds a block for a request, a pin or a reservation."""
    return all(r["blocks_used"] == 0 for r in stats["ranks"] if r["alive"])


async def until(predicate, what: str, limit: float = 30.0) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``limit`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} never happened")
        await asyncio.sleep(0.02)
