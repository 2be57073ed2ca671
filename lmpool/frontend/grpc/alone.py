"""``lmpool serve --grpc-port PORT --no-http``: the gRPC worker without the HTTP server.

The app's own lifespan runs here, as uvicorn would run it (the pool started on this uvloop loop,
the gRPC server once it is up, both stopped at its end), so the two modes share every start and
stop step. SIGINT or SIGTERM drains as with HTTP: new calls refused, the running ones given
``grace`` seconds, then cancelled (their requests aborted) before the pool shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop


async def _serve(app, grace: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with app.router.lifespan_context(app):
        await stop.wait()
        await app.state.grpc.stop(grace)


def run(app, grace: float, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    uvloop.run(_serve(app, grace))
