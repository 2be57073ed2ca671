"""Waiting for a state to be reached: poll a condition until it holds or a deadline passes.

The deadline (``limit``, in seconds) is a ceiling for a loaded machine, a guard against a
hang: a passing test never gets near it, and a test never asserts how soon a state came.
``wait_until`` blocks the thread; ``until`` yields to the event loop between polls and also
takes a condition that returns an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
import time


def _gave_up(what: str, limit: float, show) -> AssertionError:
    return AssertionError(f"timed out after {limit:g} s waiting for {what}" + (f": {show()}" if show else ""))


def wait_until(condition, what: str, *, limit: float, show=None, interval: float = 0.1):
    """The first true value ``condition()`` returns. After ``limit`` s without one, fail
    naming ``what`` and, if given, what ``show()`` returns (say, a log). An ``interval`` of 0
    polls without pausing, for a condition that is itself the work (reading as fast as it can)."""
    deadline = time.monotonic() + limit
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise _gave_up(what, limit, show)
        if interval:
            time.sleep(interval)


async def until(condition, what: str, *, limit: float, show=None, interval: float = 0.05):
    """``wait_until`` on an event loop: ``condition()`` may return an awaitable (then its result
    counts), and the loop runs other tasks between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() > deadline:
            raise _gave_up(what, limit, show)
        await asyncio.sleep(interval)
