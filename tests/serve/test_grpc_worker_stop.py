"""The gRPC worker's stop after a start that failed half way (the servicer refused its model):
the start's own error is what the caller sees, and the stop still closes the event feed and
removes the private socket directory."""

from __future__ import annotations

import asyncio
import types

import pytest

from lmpool.frontend.grpc import worker as worker_module
from lmpool.frontend.grpc.worker import GrpcWorker


class Feed:
    def __init__(self) -> None:
        self.closed = False

    def start(self) -> None:
        pass

    def end_streams(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def test_a_start_that_failed_half_way_stops_cleanly(tmp_path, monkeypatch):
    def refuse(*args):
        raise OSError("config.json is unreadable")

    monkeypatch.setattr(worker_module, "PoolEngineServicer", refuse)
    private = tmp_path / "private"
    private.mkdir()
    worker = GrpcWorker("127.0.0.1", 0, "ipc://unused", "ipc://unused-replay", "kv-events", True, str(private))
    worker.feed = feed = Feed()
    settings = types.SimpleNamespace(limits=types.SimpleNamespace(limit_concurrency=8))

    async def start_then_stop() -> None:
        try:
            await worker.start(pool=None, settings=settings)
        finally:
            await worker.stop(0)

    with pytest.raises(OSError, match="unreadable"):
        asyncio.run(start_then_stop())
    assert feed.closed and not private.exists()
