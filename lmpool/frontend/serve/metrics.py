"""``/metrics`` of the server: the pool's Prometheus registry, rendered in this process.

The server starts its pool with metrics on and no port of their own (``metrics=True``), and
renders the pool's registry (``prometheus_client.generate_latest``) on the event loop: the board
is read from shared memory and the page formatted in well under a millisecond, so a scrape adds
nothing to the pool's work and needs no thread or loopback fetch. Series carry the served
model's name as ``model_name``.
"""

from __future__ import annotations

from fastapi.responses import Response

from lmpool.frontend.serve.errors import ServeError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def scrape(pool) -> Response:
    if pool.metrics_registry is None:
        raise ServeError(404, "metrics are off: install 'lmpool[metrics]'")
    import prometheus_client

    return Response(prometheus_client.generate_latest(pool.metrics_registry), media_type=CONTENT_TYPE)
