"""Running a request's coroutine only for as long as its HTTP client stays connected.

A non-streaming handler is not cancelled by the server when its client goes away; this races
the work against the client's ``http.disconnect`` so that a client that leaves aborts its
request (the pool's ``stream`` aborts a request whose consumer is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _disconnected(request: Request) -> None:
    # Once the body has been read, the next receive() waits until the client disconnects.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro):
    """``await coro``, or cancel it and raise ``ClientGone`` when the client leaves first."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        for task in (watch, work):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if work.cancelled():
        raise ClientGone()
    return work.result()
