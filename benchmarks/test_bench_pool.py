"""Pool runtime microbenchmarks on CPU (``python -m pytest benchmarks/test_bench_pool.py -s``).

- Route queries per second over the rings: a real control process with 8 ranks
  whose reports this process plays, queried by 64 concurrent requesters over the
  engine's request/response link (the path every request takes).
- ``AsyncLMPool`` inside an application's running uvloop loop: 1,000 concurrent
  streaming requests on CPU replicas while a 10 ms timer runs in the same loop;
  the timer's lag (how late each tick fires) is what the application would feel.

Figures are printed and written to ``benchmarks/results/pool_cpu.json`` (or
``LMPOOL_BENCH_JSON``); nothing is asserted about speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import uvloop

from lmpool.cli import default_model
from lmpool.engine.hashing import chain_hashes
from lmpool.protocol.kv_events import BlockStored, KVSnapshot
from lmpool.frontend import launcher as process
from lmpool.frontend.api import AsyncLMPool
from lmpool.protocol import ControlStats, LoadReport, RouteDecision, RouteQuery, WaitRanks, WorkerSnapshot
from lmpool.config.pool import PoolConfig
from lmpool.protocol.spec import ControlSpec
from lmpool.sampling_params import SamplingParams
from lmpool_ipc import Channel, IpcPool, Requester

RESULT = Path(os.environ.get("LMPOOL_BENCH_JSON", Path(__file__).parent / "results" / "pool_cpu.json"))
RESULTS: dict = {}


def save() -> None:
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    existing.update(RESULTS)
    existing["environment"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    RESULT.write_text(json.dumps(existing, indent=2) + "\n")


async def route_rpc(world: int, blocks: int, concurrency: int, seconds: float) -> dict:
    ipc = IpcPool.start()
    try:
        engine_link = ipc.create_link()
        worker_links = [ipc.create_link() for _ in range(world)]
        spec = ControlSpec(pool=PoolConfig.from_options("unused", world_size=world, device="cpu", block_size=16),
                           frontend_end=engine_link.b, worker_ends=[l.a for l in worker_links])
        proc = process.spawn("lmpool.control.main", spec)
        workers = [Channel(l.b, object) for l in worker_links]
        # Each rank caches its own family of 40-block chains.
        families = [[chain_hashes([r * 1000 + f] * 16 * 40, 16) for f in range(blocks // 40)] for r in range(world)]
        for r, ch in enumerate(workers):
            stored = []
            for chain in families[r]:
                stored += [BlockStored(h, p, i, 1) for i, (h, p) in enumerate(zip(chain, [0] + chain[:-1]))]
            await ch.send(WorkerSnapshot(r, 1, 1 << 20, KVSnapshot(len(stored), stored), LoadReport(blocks_free=1 << 20)))
        channel = Channel(engine_link.a, object)
        channel.expect_peer(proc.pid)
        requester = Requester(channel, RouteDecision | ControlStats | None)
        await requester.request(WaitRanks(list(range(world))))
        done = 0
        deadline = time.perf_counter() + seconds

        async def client(c: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < deadline:
                chain = families[(c + i) % world][i % len(families[0])]
                await requester.request(RouteQuery(f"{c}-{i}", chain, 16 * 40, 16))
                i += 1
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        elapsed = time.perf_counter() - start
        requester.close()
        channel.close()
        for ch in workers:
            ch.close()
        process.stop(proc, 5.0)
        return {"world_size": world, "page_table_entries": world * blocks, "concurrency": concurrency,
                "route_queries": done, "seconds": elapsed, "route_queries_per_s": done / elapsed}
    finally:
        ipc.close()


def test_route_queries_per_second_over_rings():
    result = uvloop.run(route_rpc(world=8, blocks=4000, concurrency=64, seconds=5.0))
    print(f"\nroute queries over the rings: {result['route_queries_per_s']:,.0f}/s "
          f"({result['concurrency']} concurrent requesters, 8 ranks) - goal >= 10,000/s")
    RESULTS["route_rpc"] = result
    save()


async def async_pool_lag(model: str, n: int, max_tokens: int) -> dict:
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            start = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - start - 0.01)

    async with AsyncLMPool(model, world_size=2, block_size=16) as pool:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def one(i: int) -> int:
            tokens = 0
            async for _ in pool.stream([i % 900 + 1, 7, 9, 11], params):
                tokens += 1
            return tokens

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - start
        stop.set()
        await tick
    assert sum(counts) == n * max_tokens
    lag_ms = np.array(lags) * 1e3
    return {"requests": n, "max_tokens": max_tokens, "world_size": 2, "seconds": elapsed,
            "timer_ticks": len(lags), "timer_lag_p50_ms": float(np.percentile(lag_ms, 50)),
            "timer_lag_p99_ms": float(np.percentile(lag_ms, 99)), "timer_lag_max_ms": float(lag_ms.max())}


def test_async_pool_timer_lag_with_1000_streams():
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("LMPOOL_CACHE", cache)
        result = uvloop.run(async_pool_lag(str(default_model()), n=1000, max_tokens=8))
    print(f"\n1,000 concurrent streams in {result['seconds']:.1f} s; 10 ms timer lag "
          f"p50 {result['timer_lag_p50_ms']:.1f} ms, p99 {result['timer_lag_p99_ms']:.1f} ms - goal p99 < 50 ms")
    RESULTS["async_pool_1000_streams"] = result
    save()


if __name__ == "__main__":
    pytest.main([__file__, "-s"])
