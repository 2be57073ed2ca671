"""What gateways in front of ``lmpool serve`` probe for, besides the OpenAI API.

SGLang's model gateway (``smg``) tells an HTTP worker's engine by ``/v1/models``' ``owned_by``,
else by ``GET /version`` (answered: vLLM) and ``GET /server_info`` (answered, no ``/version``:
SGLang); a worker that answers neither is registered as ``generic``. It reads every HTTP
worker's load from ``GET /v1/loads`` (SGLang's load schema), whatever the engine, and falls
back to the engine's own Prometheus gauges (``vllm:``/``sglang:`` names) where that route is
absent. So a host here answers:

- ``/server_info`` and ``/model_info``, in SGLang's shape (the fields smg reads), and no
  ``/version``: smg registers the host as ``sglang``, whose metadata it reads from these two.
  ``lmpool serve --enable-version-route`` answers vLLM's ``GET /version`` (``{"version"}``) for
  the clients and scripts that probe it; smg then registers the host as ``vllm`` instead.
- ``/v1/loads``: the pool's live ranks as one engine, in SGLang's load schema.
- ``/v1/responses`` (and its sub-paths): a 501 OpenAI-style error. smg advertises the Responses
  API for every worker whatever its engine, and forwards it as is; a 501 says what is missing,
  where a 404 reads as a wrong address, and smg neither retries it nor counts it against the
  host's circuit breaker (those take 408, 429 and 5xx other than 501).

Invariants: the figures come from ``AsyncLMPool.stats()`` and the pool's configuration only,
read when asked (nothing is cached); a dead rank counts for nothing (no requests, no capacity),
so a host with a dead rank never looks idler than it is; a field the pool cannot fill honestly
(generation throughput, queued uncached tokens) is left out, which smg reads as unreported.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata

from fastapi import FastAPI, Request

from lmpool.frontend.serve.errors import ServeError

NOT_IMPLEMENTED = ("The Responses API (/v1/responses) is not implemented by this server; "
                   "use /v1/chat/completions or /v1/completions.")


@functools.cache
def lmpool_version() -> str:
    try:
        return importlib.metadata.version("lmpool")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def host_load(pool) -> dict:
    """The live ranks' figures summed: one engine, as the gateway routes to the host, not to a rank."""
    stats = await pool.stats()
    live = [rank for rank in stats["ranks"] if rank["alive"]]
    block_size = pool.client.block_size
    used = sum(rank["blocks_used"] for rank in live)
    # The capacity lmpool:kv_cache_usage_perc divides by: blocks held by cached prefixes
    # (reclaimable) are free to the next request, so they count as room, not as use.
    total = sum(rank["blocks_used"] + rank["blocks_reclaimable"] + rank["blocks_free"] for rank in live)
    prompt_tokens = sum(rank["prompt_tokens"] for rank in live)
    running = sum(rank["num_running"] for rank in live)
    waiting = sum(rank["num_waiting"] for rank in live)
    return {
        "running": running, "waiting": waiting, "used_tokens": used * block_size,
        "total_tokens": total * block_size, "usage": used / total if total else 0.0,
        # Since the ranks started, as SGLang's figure: cached prompt tokens over prompt tokens.
        "hit_rate": sum(rank["prefix_hit_tokens"] for rank in live) / prompt_tokens if prompt_tokens else 0.0,
        "max_running": pool.config.engine.max_num_seqs * len(live),
        "live_ranks": len(live), "ranks": len(stats["ranks"]),
    }


def register(app: FastAPI) -> None:
    settings = app.state.settings

    @app.get("/server_info")
    async def server_info(request: Request):
        pool = request.app.state.pool
        load = await host_load(pool)
        return {
            "model_path": settings.model,
            "served_model_name": settings.name,
            # One: the ranks are not addressable by the gateway (the pool routes each request
            # itself and ignores a request's data_parallel_rank), so smg's --dp-aware mode must
            # see one scheduler here, not split the host into ranks it cannot pin.
            "dp_size": 1,
            "context_length": pool.client.max_model_len,
            "max_total_tokens": load["total_tokens"],
            "max_running_requests": load["max_running"],
            "is_embedding": False,
            "disaggregation_mode": "null",
            "version": lmpool_version(),
            # This server's own: what the figures above are made of.
            "engine": "lmpool",
            "ranks": load["ranks"],
            "live_ranks": load["live_ranks"],
            "block_size": pool.client.block_size,
        }

    if settings.version_route:
        @app.get("/version")
        async def version():
            return {"version": lmpool_version()}

    @app.get("/model_info")
    async def model_info():
        return {"model_path": settings.model, "is_generation": True, "has_image_understanding": False,
                "has_audio_understanding": False}

    @app.get("/v1/loads")
    async def loads(request: Request):
        # ``include`` (core, disagg, queues, memory) is accepted and ignored: the core section is
        # all there is; the others' fields are optional in smg's schema and stay absent.
        load = await host_load(request.app.state.pool)
        if not load["live_ranks"]:
            # As /health: a host that can serve nothing has no load to report. smg reads a
            # failed probe as "no reading" (the host stays in its probe list), not as idle.
            raise ServeError(503, "no rank is alive")
        snapshot = {
            "dp_rank": 0,
            "num_running_reqs": load["running"],
            "num_waiting_reqs": load["waiting"],
            "num_total_reqs": load["running"] + load["waiting"],
            "num_used_tokens": load["used_tokens"],
            "max_total_num_tokens": load["total_tokens"],
            "token_usage": load["usage"],
            "cache_hit_rate": load["hit_rate"],
            "max_running_requests": load["max_running"],
        }
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return {"timestamp": now, "dp_rank_count": 1, "loads": [snapshot]}

    @app.api_route("/v1/responses", methods=["GET", "POST", "DELETE"])
    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def responses():
        raise ServeError(501, NOT_IMPLEMENTED)
