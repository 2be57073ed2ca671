"""Waiting for a pool to reach a state: poll its stats until a condition holds or a
deadline passes (a state to reach, never a fixed delay). The polling is ``waiting``'s; the
pool tests' ceiling is 30 s unless a call names its own."""

from __future__ import annotations

import waiting


async def settled(pool, condition, what: str, limit: float = 30.0) -> dict:
    """The first ``pool.stats()`` for which ``condition`` holds; fails naming ``what`` after ``limit`` s."""
    last = {}

    async def check() -> dict | None:
        last["stats"] = stats = await pool.stats()
        return stats if condition(stats) else None

    return await waiting.until(check, what, limit=limit, show=lambda: f"last stats: {last.get('stats')}")


def no_blocks_held(stats: dict) -> bool:
    """No live rank holds a block for a request, a pin or a reservation."""
    return all(r["blocks_used"] == 0 for r in stats["ranks"] if r["alive"])


async def until(predicate, what: str, limit: float = 30.0) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``limit`` s."""
    await waiting.until(predicate, what, limit=limit, interval=0.02)
