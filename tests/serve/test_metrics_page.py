"""The server's ``/metrics`` is the pool's Prometheus registry rendered in the server's process
(``prometheus_client.generate_latest``), not a page fetched from an exporter of its own over
loopback: the server starts its pool with ``metrics=True`` and no metrics port, and the page is
byte for byte the registry's. No pool is started here (the app over a fake pool); the pool's own
series, labelled with the served model's name, are in ``tests/tools/test_metrics.py``."""

from __future__ import annotations

import httpx
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.server import parser, settings_from
from lmpool.frontend.serve.settings import ServeSettings


class FakePool:
    def __init__(self, registry) -> None:
        self.metrics_registry = registry


async def get_metrics(pool) -> httpx.Response:
    app = create_app(ServeSettings("/models/tiny", served_model_name="tiny"))
    app.state.pool = pool
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host") as client:
        return await client.get("/metrics")


async def test_the_page_is_the_pool_registry_rendered():
    registry = prometheus_client.CollectorRegistry()
    tokens = prometheus_client.Counter("lmpool:generation_tokens", "Tokens generated.", ["model_name", "rank"],
                                       registry=registry)
    tokens.labels("tiny", "0").inc(7)
    response = await get_metrics(FakePool(registry))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert response.content == prometheus_client.generate_latest(registry)
    samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]
    assert [(s.labels, s.value) for s in samples if s.name == "lmpool:generation_tokens_total"] == \
        [({"model_name": "tiny", "rank": "0"}, 7.0)]
    tokens.labels("tiny", "0").inc(3)  # read at each scrape
    assert "lmpool:generation_tokens_total{model_name=\"tiny\",rank=\"0\"} 10.0" in (await get_metrics(
        FakePool(registry))).text


async def test_metrics_off_is_a_404_body():
    response = await get_metrics(FakePool(None))
    assert response.status_code == 404 and "metrics are off" in response.json()["error"]["message"]


def test_the_server_asks_its_pool_for_metrics_in_process_without_a_port():
    settings = settings_from(parser().parse_args(["model", "--served-model-name", "tiny"]))
    assert settings.pool_args["metrics"] is True and "metrics_port" not in settings.pool_args
