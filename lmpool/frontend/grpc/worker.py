"""The gRPC side of ``lmpool serve --grpc-port``: its KV-event plumbing, its server's start and drain.

``GrpcWorker.from_args`` is called before the pool starts: it picks the endpoints the pool's
KV-event publisher binds (those of ``--kv-events-endpoint`` when given, plus a replay endpoint
if it names none; otherwise private ``ipc://`` sockets in a directory only this user can enter:
``private_sockets``) and returns the publisher's configuration, so ``--grpc-port`` alone gives
smg the events.
``start`` runs once the pool is up, on the server's event loop; ``stop(grace)`` ends the event
subscriptions (they never end by themselves), refuses new calls, gives the running ones
``grace`` seconds, then cancels them (which aborts their requests). It is idempotent: SIGTERM's
drain calls it first, the app's shutdown again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from smg_grpc_servicer.kv_events import endpoint_for_rank

from lmpool.config.kv_events import KVEventsConfig
from lmpool.frontend.grpc import private_sockets
from lmpool.frontend.grpc.event_feed import PoolEventFeed
from lmpool.frontend.grpc.servicer import PoolEngineServicer

log = logging.getLogger("uvicorn.error")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 1M-token prompt is 4-5 MB of varints; the tokenizer comes in chunks


class GrpcWorker:
    def __init__(self, host: str, port: int, endpoint: str, replay_endpoint: str, topic: str, array_like: bool,
                 private_dir: str | None) -> None:
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic, self.array_like, self._private_dir = topic, array_like, private_dir
        self.feed: PoolEventFeed | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: PoolEngineServicer | None = None
        self.port: int | None = None
        self._stopping: asyncio.Task | None = None

    @classmethod
    def from_args(cls, args) -> tuple[GrpcWorker, KVEventsConfig]:
        """The worker ``args`` ask for, and the KV-event publisher's configuration it needs."""
        private = None
        if args.kv_events_endpoint:
            endpoint, replay = args.kv_events_endpoint, args.kv_events_replay_endpoint
        else:
            endpoint = replay = None
        if replay is None:
            private = private_sockets.make()
            endpoint = endpoint or f"ipc://{private}/events"
            replay = f"ipc://{private}/replay"
        worker = cls(args.host, args.grpc_port, endpoint_for_rank(endpoint, 0), endpoint_for_rank(replay, 0),
                     args.kv_events_topic, not args.kv_events_map_layout, private)
        config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay, topic=args.kv_events_topic,
                                buffer_steps=args.kv_events_buffer_steps, array_like=worker.array_like,
                                int_hashes=not args.kv_events_bytes_hashes)
        return worker, config

    def connect(self) -> None:
        """Listen to the publisher before the pool binds it (so its first batches are heard)."""
        self.feed = PoolEventFeed(self.endpoint, self.replay_endpoint, self.topic, self.array_like)

    async def start(self, pool, settings) -> None:
        assert self.feed is not None  # connect() came first
        self.feed.start()
        # As many calls at once as the HTTP server takes requests (past it, RESOURCE_EXHAUSTED).
        self.server = grpc.aio.server(maximum_concurrent_rpcs=settings.limits.limit_concurrency,
                                      options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self.servicer = PoolEngineServicer(pool, settings, self.feed)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(self.address)
        await self.server.start()
        log.info("gRPC worker (smg's vLLM engine protocol) listening on %s, port %d", self.address, self.port)

    def stop(self, grace: float) -> asyncio.Task:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        return self._stopping

    async def _stop(self, grace: float) -> None:
        # Each part stops whatever start() got to: a start that failed half way (the servicer's
        # model files unreadable, say) still closes the feed and the private sockets.
        try:
            if self.feed is not None:
                self.feed.end_streams()
            if self.server is not None:
                await self.server.stop(grace)
            if self.servicer is not None:
                self.servicer.close()
        finally:
            try:
                if self.feed is not None:
                    await self.feed.close()
            finally:
                if self._private_dir is not None:
                    shutil.rmtree(self._private_dir, ignore_errors=True)
