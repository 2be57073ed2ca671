"""``lmpool serve``: the OpenAI-compatible server's command line and its uvicorn run.

uvicorn runs the app on a uvloop loop; the app's lifespan starts the pool on that same loop
before the port is bound, so ``/health`` answers only once every replica is ready (a missing
model, a setting the pool refuses and a port already taken are reported first, before the
pool starts: one line, exit code 2 for the arguments). SIGINT or
SIGTERM stops the server gracefully, which shuts the pool down (no process or shared-memory
object outlives it): it stops accepting connections, gives the running requests
``--shutdown-grace`` seconds to finish, then shuts the pool down, which fails those still
running as any request on a shut-down pool fails (a 503 body, or a stream's in-band error and
``[DONE]``). Left to uvicorn, they would be cancelled: a plain-text 500, or a stream cut short.

Every bound on clients (body and header sizes, the deadlines for sending a request, keep-alive,
concurrency, backlog) is an ``HttpLimits`` field, set from the command line and handed to
uvicorn by ``uvicorn_config`` alone; the protocol it runs is ``http_limits``' (uvicorn's
httptools one, with the deadlines uvicorn lacks).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import socket

from lmpool.config.engine import check_port
from lmpool.config.kv_events import KVEventsConfig
from lmpool.config.pool import ROUTINGS
from lmpool.frontend.serve.settings import HttpLimits, ServeSettings
from lmpool.frontend.serve.vllm_kv_events_config import parse_kv_events_config


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmpool serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model", help="a Qwen3 checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--served-model-name", help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--world-size", "--data-parallel-size", "-dp", dest="world_size", type=int, default=1,
                   help="data-parallel replicas (--data-parallel-size and -dp are vLLM's names for it)")
    p.add_argument("--device", default=default_device(),
                   help="cuda (replica r on GPU r modulo the GPUs) or cpu (default: cuda when present, as lmpool demo)")
    p.add_argument("--dtype", help="the weights' dtype (default: the engine's for the device)")
    p.add_argument("--routing", default="lmpool", choices=ROUTINGS, help="the pool's routing policy (default: lmpool)")
    p.add_argument("--block-size", type=int, help="KV block size in tokens")
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks per replica (default: sized from memory)")
    p.add_argument("--max-num-seqs", type=int, help="running requests per replica")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens one engine step schedules per replica")
    p.add_argument("--max-model-len", type=int, help="longest prompt plus output, in tokens")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--piecewise-graph-max-tokens", type=int,
                   help="steps that prefill, of at most this many tokens, replay CUDA graphs of every layer's work "
                        "but its attention (default: 512; 0: never)")
    p.add_argument("--cascade-min-saved-tokens", type=int,
                   help="decode rows sharing cached prefixes read them once when that saves this many key reads "
                        "(default: 65536 where the CUDA kernels run in half precision, else 0: never)")
    p.add_argument("--prefill-attention", choices=["lmpool", "flash"],
                   help="attention of the steps that prefill: LMPool's kernel or torch's FlashAttention over the "
                        "paged cache (default: flash where the CUDA kernels run in half precision, else lmpool)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="the share of each GPU the replicas on it fill together (default: 0.9)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached KV blocks of shared prefixes (default: on)")
    p.add_argument("--seed", type=int, help="the engines' random stream for unseeded sampling (rank r draws from "
                                            "seed + r; default: 0)")
    p.add_argument("--kv-events-endpoint", help="publish vLLM-format KV events on this ZMQ PUB endpoint "
                   "(e.g. tcp://127.0.0.1:5557); the events carry every cached block's token ids, for every "
                   "tenant, salted or not: bind to loopback or a trusted network; off unless given")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="vLLM's form of the KV-event settings, a JSON object of its KVEventsConfig fields "
                        "(enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, buffer_steps); "
                        "an endpoint left out is tcp://127.0.0.1:5557, not vLLM's tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", help="ZMQ ROUTER endpoint answering replay and snapshot "
                   "requests (e.g. tcp://127.0.0.1:5558)")
    p.add_argument("--kv-events-topic", default="kv-events")
    p.add_argument("--kv-events-buffer-steps", type=int, default=10_000, help="batches kept for replay")
    p.add_argument("--kv-events-map-layout", action="store_true",
                   help="encode events as maps (recent vLLM) rather than arrays (vLLM's subscriber example)")
    p.add_argument("--kv-events-bytes-hashes", action="store_true",
                   help="send the whole 32-byte block hashes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) "
                        "rather than vLLM's default, their low 64 bits as integers")
    p.add_argument("--grpc-port", type=_port, help="also serve smg's gRPC engine protocol (vLLM's) on this port, "
                   "on --host, with the pool's KV events and loads (smg: --worker-urls grpc://HOST:PORT)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only (with --grpc-port): no HTTP port")
    p.add_argument("--shutdown-grace", type=_seconds, default=5.0,
                   help="seconds the running requests get to finish once SIGINT or SIGTERM stops the server")
    p.add_argument("--enable-version-route", action="store_true",
                   help="answer vLLM's GET /version; SGLang's gateway (smg) then takes this host for a vLLM worker "
                        "rather than an SGLang one")
    p.add_argument("--log-level", default="info")
    limits = p.add_argument_group(
        "client limits", "What a client may send, and how slowly. A body over the limit is a 413 (refused from its "
        "Content-Length before it is read, or once a chunked body passes it); a request head over its limit a 431; "
        "a request not sent within its deadlines a 408, and the connection closed. Bodies over "
        f"{HttpLimits.inline_parse_bytes // 1024} KiB are decoded in a separate process, so that they do not pause "
        "other requests' streams.")
    limits.add_argument("--max-request-bytes", type=_count, default=HttpLimits.max_request_bytes, metavar="N",
                        help="the largest request body, in bytes (default: 32 MiB, ample for a 1M-token prompt as "
                             "token ids or text)")
    limits.add_argument("--max-header-bytes", type=_count, default=HttpLimits.max_header_bytes, metavar="N",
                        help="the largest request line and headers, in bytes (default: %(default)s)")
    limits.add_argument("--timeout-request-headers", type=_positive_seconds, metavar="S",
                        default=HttpLimits.timeout_request_headers_s,
                        help="seconds a client has to send a request's line and headers, from the connection "
                             "opening or the request's first byte (default: %(default)s)")
    limits.add_argument("--timeout-request-body", type=_positive_seconds, default=HttpLimits.timeout_request_body_s,
                        metavar="S", help="seconds a client has to send a request's body once its headers are in "
                                          "(default: %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=_positive_seconds, default=HttpLimits.timeout_keep_alive_s,
                        metavar="S", help="seconds an idle kept-alive connection stays open (default: %(default)s, "
                                          "as uvicorn and vLLM)")
    limits.add_argument("--limit-concurrency", type=_count, default=HttpLimits.limit_concurrency, metavar="N",
                        help="connections and requests at once; past it a new request is a 503; 0: no limit "
                             "(default: %(default)s)")
    limits.add_argument("--backlog", type=_count, default=HttpLimits.backlog, metavar="N",
                        help="connections the kernel queues before they are accepted (default: %(default)s)")
    return p


def _port(text: str) -> int:
    # Checked here: uvloop binds a port beyond 65535 modulo 65536, while uvicorn reports the one asked for.
    try:
        port = check_port(int(text), "--port")
        assert port is not None  # an int given, an int back
        return port
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def limits_from(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(max_request_bytes=args.max_request_bytes, max_header_bytes=args.max_header_bytes,
                      timeout_request_headers_s=args.timeout_request_headers,
                      timeout_request_body_s=args.timeout_request_body, timeout_keep_alive_s=args.timeout_keep_alive,
                      limit_concurrency=args.limit_concurrency or None, backlog=args.backlog)


def settings_from(args: argparse.Namespace) -> ServeSettings:
    pool_args: dict = {"world_size": args.world_size, "device": args.device, "routing": args.routing}
    for name in ("dtype", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enforce_eager", "gpu_memory_utilization", "enable_prefix_caching", "seed", "cascade_min_saved_tokens",
                 "prefill_attention", "piecewise_graph_max_tokens"):
        if getattr(args, name) is not None:
            pool_args[name] = getattr(args, name)
    if importlib.util.find_spec("prometheus_client") is not None:
        pool_args["metrics"] = True  # rendered at the server's /metrics
    return ServeSettings(model=args.model, served_model_name=args.served_model_name, api_key=args.api_key,
                         pool_args=pool_args, limits=limits_from(args), version_route=args.enable_version_route)


def read_kv_events_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply vLLM's ``--kv-events-config`` JSON to ``args``' own KV-event settings (it is one or
    the other: given both, the command line is refused)."""
    if args.kv_events_config is None:
        return
    if args.kv_events_endpoint or args.kv_events_replay_endpoint:
        p.error("--kv-events-config and --kv-events-endpoint/--kv-events-replay-endpoint: give one or the other")
    try:
        settings = parse_kv_events_config(args.kv_events_config)
    except ValueError as e:
        p.error(f"--kv-events-config: {e}")
    if settings is not None:
        args.kv_events_endpoint, args.kv_events_replay_endpoint = settings["endpoint"], settings["replay_endpoint"]
        args.kv_events_topic, args.kv_events_buffer_steps = settings["topic"], settings["buffer_steps"]


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """The pool's KV-event settings (``PoolConfig.kv_events``) the command line asks for."""
    if not args.kv_events_endpoint:
        return None
    return KVEventsConfig(endpoint=args.kv_events_endpoint, replay_endpoint=args.kv_events_replay_endpoint,
                          topic=args.kv_events_topic, buffer_steps=args.kv_events_buffer_steps,
                          array_like=not args.kv_events_map_layout, int_hashes=not args.kv_events_bytes_hashes)


def check_pool_args(p: argparse.ArgumentParser, settings: ServeSettings) -> None:
    """Read the model's config and build the pool's configuration once, here, so that a missing
    model or a setting the pool refuses is one line and exit code 2 before anything starts (it
    was a traceback from the app's start-up, exit 3)."""
    from lmpool.config.pool import PoolConfig
    from lmpool.model.config import ModelConfig

    options = {k: v for k, v in settings.pool_args.items() if k != "metrics"}
    try:
        ModelConfig.from_pretrained(settings.model)
        PoolConfig.from_options(settings.model, **options)
    except (OSError, ValueError, TypeError) as e:
        p.error(str(e))


def check_port_free(host: str, port: int) -> None:
    """Bind the HTTP port once, here, so that a taken one is reported at once, before the pool
    starts (uvicorn binds it for good once the pool is up; a port taken in between is its error)."""
    if port == 0:
        return  # any free port: nothing to check
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise SystemExit(f"lmpool serve: cannot bind {host}:{port}: {e.strerror or e}") from None


def check_endpoints(events: KVEventsConfig) -> None:
    """Bind the KV-event endpoints once, here, so that a taken or malformed one is reported
    before the pool starts (the control process binds them for good)."""
    import zmq

    ctx = zmq.Context()
    try:
        for kind, endpoint in ((zmq.PUB, events.endpoint), (zmq.ROUTER, events.replay_endpoint)):
            if endpoint is not None:
                with ctx.socket(kind) as sock:
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise SystemExit(f"lmpool serve: cannot bind the KV-event endpoints: {e}") from None
    finally:
        ctx.term()


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    read_kv_events_config(p, args)
    try:
        import uvicorn  # noqa: F401  (only that it imports: the serve extra is installed)

        from lmpool.frontend.serve.app import create_app
    except ImportError as e:
        raise SystemExit(f"lmpool serve needs the serve extra (pip install 'lmpool[serve]'): {e}") from None
    settings = settings_from(args)
    check_pool_args(p, settings)
    if args.no_http and args.grpc_port is None:
        p.error("--no-http needs --grpc-port")
    if not args.no_http:
        check_port_free(args.host, args.port)
    events = kv_events_config(args)
    if events is not None:
        check_endpoints(events)
    grpc_worker = None
    if args.grpc_port is not None:  # smg's gRPC worker; it reads the pool's KV events
        check_port_free(args.host, args.grpc_port)
        grpc_worker, events = _grpc_worker(args)
    settings.pool_args["kv_events"] = events
    app = create_app(settings)
    app.state.grpc = grpc_worker
    # The server's process holds what it has loaded (torch among it) for as long as it serves:
    # the collector's full passes need not walk it (over torch's objects, one holds the loop that
    # routes every request for about a tenth of a second).
    gc.collect()
    gc.freeze()
    if args.no_http:
        from lmpool.frontend.grpc.alone import run

        run(app, args.shutdown_grace, args.log_level)
        return 0
    _server_class()(uvicorn_config(app, args, settings.limits), app, args.shutdown_grace).run()
    return 0


def _grpc_worker(args: argparse.Namespace):
    try:
        from lmpool.frontend.grpc.worker import GrpcWorker
    except ImportError as e:
        raise SystemExit(f"lmpool serve --grpc-port needs the grpc extra (pip install 'lmpool[grpc]'): {e}") from None
    return GrpcWorker.from_args(args)


def uvicorn_config(app, args: argparse.Namespace, limits: HttpLimits):
    """The uvicorn configuration of ``lmpool serve``: every limit on clients set here, from ``limits``."""
    import uvicorn

    from lmpool.frontend.serve.http_limits import limited_protocol

    return uvicorn.Config(
        app, host=args.host, port=args.port, loop="uvloop", log_level=args.log_level, access_log=False,
        http=limited_protocol(limits),
        ws="none",  # the API has no WebSocket route: an upgrade request is served as plain HTTP
        # uvicorn annotates an int; it takes any number of seconds (loop.call_later).
        timeout_keep_alive=limits.timeout_keep_alive_s,  # type: ignore[arg-type]
        limit_concurrency=limits.limit_concurrency,
        backlog=limits.backlog,
        # The head cap for uvicorn's h11 parser, which ``http`` does not choose: set alike, so the bound
        # holds should the parser be switched.
        h11_max_incomplete_event_size=limits.max_header_bytes,
        # uvicorn's own grace is a backstop, should the pool take long to stop.
        timeout_graceful_shutdown=args.shutdown_grace + POOL_STOP_S)


POOL_STOP_S = 30  # time the pool takes to stop its processes, at most


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, shutting the pool down once the running requests had ``grace``
        seconds to finish (this module's docstring says why)."""

        def __init__(self, config, app, grace: float) -> None:
            super().__init__(config)
            self.served_app, self.grace = app, grace

        async def shutdown(self, sockets=None) -> None:
            self._stopping = None
            grpc_worker = getattr(self.served_app.state, "grpc", None)
            if grpc_worker is not None:  # drains beside HTTP: new calls refused, running ones given the grace
                grpc_worker.stop(self.grace)
            timer = asyncio.get_running_loop().call_later(self.grace, self._stop_pool)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()
                if self._stopping is not None:
                    await self._stopping  # once begun, a shutdown runs to its end (its processes stopped)

        def _stop_pool(self) -> None:
            pool = getattr(self.served_app.state, "pool", None)  # None: stopped while the pool was starting
            if pool is not None:
                self._stopping = asyncio.ensure_future(pool.shutdown())

    return Server
