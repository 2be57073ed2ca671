"""What SGLang's model gateway (``smg``) probes on a host: ``/server_info`` and ``/model_info``
identify it (as ``sglang``: no ``/version``), ``/v1/loads`` gives its load in the schema smg
parses, ``/v1/responses`` is a 501, not a 404.

No pool is started: the app's handlers read a fake pool's ``stats()`` and configuration (the
lifespan, which would start a real one, never runs). The field names and types asserted are
those of smg's ``ServerInfo``/``ModelInfo`` (``workflow/steps/local/discover_metadata.rs``) and
``WorkerLoadResponse``/``SchedulerLoadSnapshot`` (``crates/protocols/src/worker.rs``). The last
test puts the real ``smg`` binary in front of the app (under uvicorn, loopback only) and reads
smg's own worker listing and ``/get_loads``.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from serve_process import free_port, smg_binary, wait_for

from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.ecosystem import lmpool_version
from lmpool.frontend.serve.settings import ServeSettings

BLOCK = 16


def rank(n: int, alive: bool = True, *, running=0, waiting=0, used=0, reclaimable=0, free=0, prompt=0, hit=0):
    return {"rank": n, "alive": alive, "num_running": running, "num_waiting": waiting, "blocks_used": used,
            "blocks_reclaimable": reclaimable, "blocks_free": free, "prompt_tokens": prompt, "prefix_hit_tokens": hit}


class FakePool:
    """What the handlers read of an ``AsyncLMPool``: ``stats()``, ``engine`` and ``config``."""

    metrics_registry = None

    def __init__(self, ranks: list[dict]) -> None:
        self.ranks = ranks
        self.client = SimpleNamespace(block_size=BLOCK, max_model_len=4096,
                                      ranks=[SimpleNamespace(rank=r["rank"], alive=r["alive"]) for r in ranks])
        self.config = SimpleNamespace(engine=SimpleNamespace(max_num_seqs=8))

    async def stats(self) -> dict:
        return {"ranks": self.ranks}


def three_ranks() -> FakePool:
    # Two live ranks of 100 blocks; a dead one whose history (its prompt counters) must not count.
    return FakePool([
        rank(0, running=2, waiting=1, used=30, reclaimable=10, free=60, prompt=400, hit=100),
        rank(1, running=1, used=10, free=90, prompt=100),
        rank(2, alive=False, prompt=1000, hit=1000),
    ])


def app_over(pool, **settings):
    app = create_app(ServeSettings("/models/tiny", served_model_name="tiny", **settings))
    app.state.pool = pool
    return app


async def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host") as client:
        return await client.request(method, path, **kwargs)


async def test_server_info_has_smg_s_fields():
    info = (await call(app_over(three_ranks()), "GET", "/server_info")).json()
    # ServerInfo: model_path, served_model_name, dp_size, context_length, max_total_tokens,
    # max_running_requests, is_embedding, disaggregation_mode, version (all optional there).
    assert info["model_path"] == "/models/tiny"
    assert info["served_model_name"] == "tiny"
    assert info["dp_size"] == 1  # the ranks are the pool's to route to, not the gateway's
    assert info["context_length"] == 4096
    assert info["max_total_tokens"] == 200 * BLOCK  # the live ranks' blocks
    assert info["max_running_requests"] == 2 * 8
    assert info["is_embedding"] is False
    assert info["disaggregation_mode"] == "null"
    assert isinstance(info["version"], str) and info["version"]
    assert (info["engine"], info["ranks"], info["live_ranks"], info["block_size"]) == ("lmpool", 3, 2, BLOCK)


async def test_model_info_says_a_text_generation_model():
    info = (await call(app_over(three_ranks()), "GET", "/model_info")).json()
    assert info == {"model_path": "/models/tiny", "is_generation": True, "has_image_understanding": False,
                    "has_audio_understanding": False}


async def test_no_version_route_unless_asked():
    # /version is vLLM's mark to smg, which would then read vLLM's metadata and gauges.
    assert (await call(app_over(three_ranks()), "GET", "/version")).status_code == 404
    asked = await call(app_over(three_ranks(), version_route=True), "GET", "/version")
    assert asked.status_code == 200 and asked.json() == {"version": lmpool_version()}


async def test_loads_are_the_live_ranks_as_one_engine_in_smg_s_schema():
    got = await call(app_over(three_ranks()), "GET", "/v1/loads", params={"include": "core,disagg,queues,memory"})
    assert got.status_code == 200
    body = got.json()
    assert set(body) == {"timestamp", "dp_rank_count", "loads"}
    assert isinstance(body["timestamp"], str) and body["timestamp"].endswith("+00:00")
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    snapshot = body["loads"][0]
    ints = {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_total_reqs": 4,
            "num_used_tokens": 40 * BLOCK, "max_total_num_tokens": 200 * BLOCK, "max_running_requests": 16}
    floats = {"token_usage": 40 / 200, "cache_hit_rate": 100 / 500}
    assert set(snapshot) == set(ints) | set(floats)  # unfilled fields are absent, not zero
    for name, value in ints.items():
        assert type(snapshot[name]) is int and snapshot[name] == value, name  # smg parses i32
    for name, value in floats.items():
        assert type(snapshot[name]) is float and snapshot[name] == pytest.approx(value), name


async def test_an_idle_host_reads_as_zero_usage_with_its_capacity():
    pool = FakePool([rank(0, free=50), rank(1, free=50)])
    snapshot = (await call(app_over(pool), "GET", "/v1/loads")).json()["loads"][0]
    # A positive max_total_num_tokens is smg's sign that the used-token figure is real.
    assert snapshot["max_total_num_tokens"] == 100 * BLOCK and snapshot["num_used_tokens"] == 0
    assert snapshot["token_usage"] == 0.0 and snapshot["cache_hit_rate"] == 0.0


async def test_no_live_rank_no_load():
    got = await call(app_over(FakePool([rank(0, alive=False)])), "GET", "/v1/loads")
    assert got.status_code == 503
    assert got.json()["error"] == {"message": "no rank is alive", "type": "ServiceUnavailableError",
                                   "param": None, "code": 503}


@pytest.mark.parametrize("method,path", [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                                         ("DELETE", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
                                         ("GET", "/v1/responses/resp_1/input_items")])
async def test_responses_api_is_a_501(method, path):
    got = await call(app_over(three_ranks()), method, path, json={"model": "tiny", "input": "hi"})
    assert got.status_code == 501
    error = got.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("NotImplementedError", 501, None)
    assert "/v1/chat/completions" in error["message"]


async def test_the_api_key_guards_the_probes_that_name_the_model():
    app = app_over(three_ranks(), api_key="s3cret")
    for path in ("/server_info", "/model_info", "/v1/loads"):
        assert (await call(app, "GET", path)).status_code == 401, path
        assert (await call(app, "GET", path, headers={"authorization": "Bearer s3cret"})).status_code == 200, path
    assert (await call(app, "GET", "/health")).status_code == 200


# ---- the real gateway ----------------------------------------------------------------------


@pytest.fixture
def host():
    """The app over a fake pool, served by uvicorn on a loopback port (no lifespan: no pool)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections queue in the kernel until the server takes them: no wait on its start
    config = uvicorn.Config(app_over(three_ranks()), lifespan="off", log_level="critical", http="httptools")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join()
    sock.close()


@pytest.fixture
def gateway(host, tmp_path):
    log_path = tmp_path / "smg.log"
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", host,
             "--policy", "cache_aware", "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
             "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, log=log_path, host=host)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get_json(url: str):
    try:
        got = httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None
    return got.json() if got.status_code == 200 else None


def test_smg_identifies_the_host_and_reads_its_load(gateway):
    def worker():
        assert gateway.proc.poll() is None, f"smg exited: {gateway.log.read_text()[-3000:]}"
        listing = get_json(f"{gateway.url}/workers") or {}
        return next((w for w in listing.get("workers", []) if w.get("url") == gateway.host
                     and w.get("is_healthy")), None)

    wait_for(lambda: worker() is not None, "smg's registration of the host as a healthy worker", limit=120)
    registered = worker()
    assert registered["runtime_type"] == "sglang", registered  # not "generic"
    assert registered["model_id"] == "tiny", registered
    # smg advertises the Responses API for any worker, whatever its engine: hence the 501 below.
    assert "responses" in registered["models"][0]["model_type"], registered

    def host_load():
        # smg 1.13's /get_loads: one row per polled rank of each worker, named by its url.
        loads = (get_json(f"{gateway.url}/get_loads") or {}).get("loads", [])
        return next((row for row in loads if row.get("worker") == gateway.host), None)

    wait_for(lambda: host_load() is not None, "smg reading the host's load", limit=60)
    row = host_load()
    assert (row["dp_rank"], row["num_running_reqs"], row["num_waiting_reqs"]) == (0, 3, 1)
    assert (row["num_used_tokens"], row["max_total_num_tokens"]) == (40 * BLOCK, 200 * BLOCK)
    assert row["token_usage"] == pytest.approx(0.2)  # what the cache-aware balance check reads
    assert row["cache_hit_rate"] == pytest.approx(0.2)
    # The worker listing carries the snapshot the load-aware policies are fed (its own poll).
    def fed():
        return ((worker() or {}).get("engine_load") or {}).get("loads")

    wait_for(lambda: bool(fed()), "smg feeding the host's load to its policies", limit=60)
    assert fed()[0]["token_usage"] == pytest.approx(0.2)

    # A Responses request through smg meets the host's 501, not a 404.
    got = httpx.post(f"{gateway.url}/v1/responses", json={"model": "tiny", "input": "hi"}, timeout=60)
    assert got.status_code == 501, got.text
    assert "not implemented" in got.text

    log = gateway.log.read_text()
    assert "Could not identify backend engine" not in log
