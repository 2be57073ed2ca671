"""NVIDIA Dynamo's KV router as an evaluation peer: ``dynamo_kv``.

Where ``dynamo_kv_copy`` is LMPool's reimplementation of Dynamo's rule inside LMPool's route
pipeline, this peer runs Dynamo's router itself: ``SelectionService``, the runtime-free selection
core of ``ai-dynamo-runtime`` (pinned in pyproject.toml; no etcd, NATS or GPU), in this process,
in front of a pool whose requests it routes (``dynamo_client``). It reads nothing of LMPool's but
the pool's KV events: the control plane publishes them (the pool's ``kv_events`` setting, block hashes as
vLLM sends them), ``kv_event_relay.RankRelay`` gives every rank a socket of its own as vLLM's data
parallelism does, and Dynamo subscribes to each as one worker of one data-parallel rank (worker
``r`` = rank ``r``): Dynamo listens to one socket per data-parallel rank and takes a replay
endpoint, to recover batches it missed, only for a worker of one rank. Each worker is registered
with the rank's KV blocks and batched-token budget, as a vLLM worker registers itself.

Dynamo's router settings are its own defaults, changed only by the ``DYN_*`` variables Dynamo
reads (``DYN_ROUTER_TEMPERATURE``, ``DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT``, ...). What ran is read
from Dynamo itself, the settings it logs when a service starts (``router_settings``), and goes
into the JSON with the package's version (``dynamo_record``); every run records its block size,
workers, bookings and the load left booked once its requests ended (zero when every reservation
was released).

Why the driver and not a policy in the control process: ``SelectionService``'s calls are
coroutines (answered from Dynamo's own threads, about a millisecond each on a CPU) while the
control plane routes synchronously on its one loop; and a booking moves at a request's first
token and at its end, which the process streaming the request sees and the control plane does
not. That process is where Dynamo's own frontend sits.

Invariants: a missing or broken package makes the policy unavailable (``DynamoUnavailable``),
never a substitute rule; the service, the relay and the pool are all stopped before
``run_dynamo`` returns or raises, in that order.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from lmpool.config.kv_events import KVEventsConfig

PACKAGE = "ai-dynamo-runtime"
INDEXER_THREADS = 4  # SelectionService's default
# Dynamo logs every selection at INFO; its warnings (a replayed gap, say) stay.
LOG_LEVEL = "warn"
# Seconds Dynamo may take to start a service and report its settings, and to subscribe to every rank.
SETTINGS_TIMEOUT_S = 120
SUBSCRIBE_TIMEOUT_S = 120
# The record Dynamo logs once a service has its router configuration (lib/kv-router/src/scheduling/config.rs).
CONFIG_MESSAGE = "KvRouterConfig initialized"
_LOG_FIELDS = {"time", "level", "file", "line", "target", "message"}
LIFECYCLE = {"route": "select_and_reserve", "first_token": "prefill_complete", "end": "free_reservation",
             "output_blocks": "not added (router_track_output_blocks off)", "pinned": "pinned_worker"}


class DynamoUnavailable(Exception):
    pass


def selection_service():
    """Dynamo's ``SelectionService`` class; ``DynamoUnavailable`` when the package cannot give it.
    Sets ``DYN_LOG`` to ``LOG_LEVEL`` unless it is set, before Dynamo's logging starts."""
    os.environ.setdefault("DYN_LOG", LOG_LEVEL)
    try:
        from dynamo.llm import SelectionService
    except ImportError as e:
        raise DynamoUnavailable(f"{PACKAGE} is not installed or does not load: {type(e).__name__}: {e}") from e
    return SelectionService


def dynamo_version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def dynamo_env() -> dict[str, str]:
    """The ``DYN_*`` variables this process hands Dynamo (its router settings' overrides), but
    its logging's."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DYN_") and not k.startswith("DYN_LOG")}


def router_settings() -> dict:
    """Dynamo's router configuration as Dynamo applies it under this environment: the record a
    ``SelectionService`` logs when it starts, read from a short-lived process of its own."""
    selection_service()
    env = dict(os.environ, DYN_LOG="info", DYN_LOGGING_JSONL="1")
    code = ("from dynamo.llm import SelectionService\n"
            f"SelectionService(indexer_threads={INDEXER_THREADS}).shutdown()\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=SETTINGS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise DynamoUnavailable(f"Dynamo's selection service cannot start: {type(e).__name__}: {e}") from e
    for line in (done.stderr + done.stdout).splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and str(entry.get("message", "")).startswith(CONFIG_MESSAGE):
                return {k: v for k, v in entry.items() if k not in _LOG_FIELDS}
    raise DynamoUnavailable(f"Dynamo's selection service logged no router configuration (exit {done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-300:]}")


def dynamo_record() -> dict:
    """What the policy's JSON says of Dynamo: its version and router settings, or why it cannot run."""
    record = {"package": PACKAGE, "version": dynamo_version(), "router_config": None, "env": dynamo_env(),
              "indexer_threads": INDEXER_THREADS, "lifecycle": LIFECYCLE, "error": None}
    try:
        record["router_config"] = router_settings()
    except DynamoUnavailable as e:
        record["error"] = str(e)
    return record


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_request(rank: int, relay, block_size: int, kv_blocks: int, max_num_batched_tokens: int) -> dict:
    """Rank ``rank`` as one Dynamo worker of one data-parallel rank, fed by the relay's socket for it."""
    return {"worker_id": rank, "endpoint": f"lmpool://rank/{rank}", "block_size": block_size,
            "kv_events_endpoint": relay.endpoints[rank], "replay_endpoint": relay.replay_endpoints[rank],
            "data_parallel_start_rank": rank, "data_parallel_size": 1, "total_kv_blocks": kv_blocks,
            "max_num_batched_tokens": max_num_batched_tokens}


def booked_load(service) -> dict:
    """What Dynamo still counts on the workers: requests, prefill tokens, decode blocks."""
    loads = [w for model in service.loads() for w in model.get("loads", ())]
    return {"active_requests": sum(w.get("active_requests", 0) for w in loads),
            "prefill_tokens": sum(w.get("potential_prefill_tokens", 0) for w in loads),
            "decode_blocks": sum(w.get("potential_decode_blocks", 0) for w in loads)}


async def start_router(relay, world_size: int, block_size: int, kv_blocks: int, max_num_batched_tokens: int):
    """A ``SelectionService`` with every rank registered and schedulable."""
    service = selection_service()(indexer_threads=INDEXER_THREADS)
    try:
        for rank in range(world_size):
            record = await service.upsert_worker(worker_request(rank, relay, block_size, kv_blocks,
                                                                max_num_batched_tokens))
            if record.get("lifecycle") != "schedulable":
                raise RuntimeError(f"Dynamo refused rank {rank} as a worker: {record.get('not_schedulable_reasons')}")
    except BaseException:
        service.shutdown()
        raise
    return service


class Front(NamedTuple):
    """Dynamo's router in front of a running pool: the pool's stream through it, the service, the relay."""

    client: object  # dynamo_client.DynamoRoutedPool
    service: object  # dynamo.llm.SelectionService
    relay: object  # kv_event_relay.RankRelay


def events_config() -> KVEventsConfig:
    """KV events on loopback ports of their own, block hashes as vLLM sends them: the pool's
    ``kv_events`` setting."""
    return KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                          topic="", buffer_steps=10_000, array_like=True, int_hashes=True)


@contextlib.asynccontextmanager
async def router_on(events: KVEventsConfig, args, setting) -> AsyncIterator[tuple]:
    """Dynamo's router reading the KV events a running pool publishes as ``events`` says, through
    the relay: ``(service, relay)``, both stopped on the way out. A pool that restarts on the same
    endpoints is followed (the relay resynchronises from its snapshot)."""
    from benchmarks.peers.kv_event_relay import RankRelay

    relay = service = None
    try:
        relay = await RankRelay(events.endpoint, events.replay_endpoint, args.world_size).start()
        service = await start_router(relay, args.world_size, args.block_size, setting.kv_blocks,
                                     args.max_num_batched_tokens)
        # Dynamo's listeners connect in the background, and the relay forwards nothing until each
        # rank's has subscribed: the run starts with Dynamo seeing every rank's stream from seq 0.
        try:
            await asyncio.wait_for(relay.subscribed(), SUBSCRIBE_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"Dynamo did not subscribe to every rank's KV events within {SUBSCRIBE_TIMEOUT_S} s") \
                from None
        yield service, relay
    finally:
        if service is not None:
            service.shutdown()
        if relay is not None:
            await relay.aclose()


@contextlib.asynccontextmanager
async def dynamo_in_front(pool, args, setting) -> AsyncIterator[Front]:
    """Start ``pool`` (unstarted, made for this run with its ``kv_events`` set: ``events_config``)
    and put Dynamo's router in front of it (``dynamo_on``); stop the service, the relay and the
    pool, in that order, on the way out."""
    try:
        if pool.config.kv_events is None:
            raise ValueError("Dynamo's router reads the pool's KV events: make the pool with kv_events set")
        selection_service()
        await pool.start()
        async with dynamo_on(pool, args, setting) as front:
            yield front
    finally:
        await pool.shutdown()


@contextlib.asynccontextmanager
async def dynamo_on(pool, args, setting) -> AsyncIterator[Front]:
    """Dynamo's router in front of a started ``pool`` that publishes KV events (its ``kv_events``
    set, at its start or its last reset), reading them; the service and the relay stop on the
    way out, the pool runs on."""
    from benchmarks.peers.dynamo_client import DynamoRoutedPool

    events = pool.config.kv_events
    if events is None:
        raise ValueError("Dynamo's router reads the pool's KV events: start or reset the pool with kv_events set")
    async with router_on(events, args, setting) as (service, relay):
        yield Front(DynamoRoutedPool(pool, service, args.world_size), service, relay)


def run_figures(front: Front, block_size: int) -> dict:
    """What a run records of Dynamo: its bookings, what it still counts booked, the relay's work."""
    client, relay = front.client, front.relay
    return {"version": dynamo_version(), "block_size": block_size,
            "workers": "one per rank: worker r, data-parallel rank r, its own KV-event and replay sockets",
            "selected": client.selected, "pinned": client.pinned, "prefill_completed": client.prefill_completed,
            "freed": client.freed, "booked_after": booked_load(front.service),
            "forwarded": list(relay.forwarded), "replays_served": list(relay.replays_served), "lost": relay.lost}


async def run_dynamo(pool, args, trace, setting, replay, on_done, figures) -> dict:
    """Replay ``trace`` through Dynamo's router in front of a started ``pool``, left running
    (``dynamo_on``); the run's record, shaped as ``eval_suite.run_one``'s (``figures(stats)`` adds
    the pool's), with ``dynamo``: ``run_figures``, and ``router_start_s``. Raises
    ``DynamoUnavailable`` when Dynamo cannot run."""
    record: dict = {}
    started = time.perf_counter()
    async with dynamo_on(pool, args, setting) as front:
        record["router_start_s"] = time.perf_counter() - started
        async with asyncio.timeout(args.run_timeout):
            t = time.perf_counter()
            record["requests"] = await replay(front.client, trace, setting.arrival, on_done)
            record["replay_s"] = time.perf_counter() - t
            stats = await pool.stats()
        record.update(figures(stats))
        record["dynamo"] = run_figures(front, args.block_size)
    return record
