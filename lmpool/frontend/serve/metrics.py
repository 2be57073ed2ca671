"""``/metrics`` of the server: the pool's own Prometheus exporter, relayed.

The server starts its pool with metrics on, on a loopback port of its own choosing
(``metrics_port=0``), and relays that page, so the names are exactly the pool's
(``lmpool.frontend.metrics``) and a scrape of the server adds nothing to the pool's work.
"""

from __future__ import annotations

import asyncio
import urllib.request

from fastapi.responses import Response

from lmpool.frontend.serve.errors import ServeError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as page:
        return page.read()


async def scrape(pool) -> Response:
    if pool.metrics_port is None:
        raise ServeError(404, "metrics are off: install 'lmpool[metrics]'")
    url = f"http://127.0.0.1:{pool.metrics_port}/metrics"
    # The exporter is a thread of this process; reading it blocks, so not on the event loop.
    body = await asyncio.get_running_loop().run_in_executor(None, _fetch, url)
    return Response(body, media_type=CONTENT_TYPE)
