"""Opt-in Prometheus metrics of a pool, in a registry of the user process.

Latency histograms are recorded where tokens reach the user process
(``PoolClient._deliver`` calls ``first_token``/``inter_token``). Every other figure is read,
at scrape time, from the pool-state board that the control process publishes, so the
exporter shows what ``lmpool top`` shows and adds no traffic to the pool. ``PoolMetrics``
holds the registry (``lmpool serve`` renders it at its own ``/metrics``); ``serve_http``
also serves it on a port of its own.

Names follow the serving engines' conventions (vLLM's, under the ``lmpool:`` prefix; the
README's table pairs them): every series carries ``model_name`` (the served model's name, as
vLLM labels its series), per-rank ones a ``rank`` label too; token counters count tokens, not
requests; latencies are histograms.

``prometheus_client`` is the ``metrics`` extra: it is imported only when a pool turns
metrics on. With metrics off the engine holds ``NO_METRICS``, whose hooks do nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from lmpool.protocol.state_board import ROUTE_LATENCY_BUCKETS_S, PoolState, StateBoardReader
from lmpool_ipc import BoardBusyError

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class TokenTimer:
    """Where the engine reports token latencies; this base ignores them."""

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass


NO_METRICS = TokenTimer()


class PoolMetrics(TokenTimer):
    """Records token latencies into ``registry``, which also reads the pool's board at each
    collection, for one pool until ``close``."""

    def __init__(self, board: str, model_name: str) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise ImportError(
                "metrics need prometheus-client: pip install 'lmpool[metrics]'"
            ) from None
        self.registry = prometheus_client.CollectorRegistry()
        self._ttft = prometheus_client.Histogram(
            "lmpool:time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self._itl = prometheus_client.Histogram(
            "lmpool:inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
            ["model_name"], buckets=ITL_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self._board = StateBoardReader(board)
        self.registry.register(_BoardCollector(self._board, model_name))
        self.port: int | None = None
        self._http: tuple[Any, threading.Thread] | None = None  # prometheus_client's server and its thread

    def serve_http(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve the registry at ``http://host:port/metrics`` (0: a free port, then ``port``)."""
        import prometheus_client

        self._http = prometheus_client.start_http_server(port, host, self.registry)
        self.port = self._http[0].server_port

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join()
        self._board.close()


class _BoardCollector:
    """Turns the latest board state into metric families at each scrape."""

    def __init__(self, board: StateBoardReader, model_name: str) -> None:
        self._board = board
        self._model_name = model_name

    def collect(self):
        try:
            state = self._board.read()
        except BoardBusyError:
            state = None
        if state is None:  # nothing published yet: the latency histograms alone
            return
        yield from _pool_families(state, self._model_name)


def _pool_families(state: PoolState, model_name: str):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def pool(kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        return family

    def per_rank(kind, name: str, doc: str, value_of):
        family = kind(name, doc, labels=["model_name", "rank"])
        for row in state.ranks:
            family.add_metric([model_name, str(row.rank)], value_of(row))
        return family

    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield per_rank(gauge, "lmpool:num_requests_running", "Requests in the rank's running batch.",
                   lambda r: r.num_running)
    yield per_rank(gauge, "lmpool:num_requests_waiting", "Requests queued at the rank.", lambda r: r.num_waiting)
    yield per_rank(gauge, "lmpool:kv_cache_usage_perc", "Fraction of the rank's KV blocks in use (1 = full).", _usage)
    blocks = gauge("lmpool:kv_cache_blocks", "The rank's KV blocks by state.", labels=["model_name", "rank", "state"])
    for row in state.ranks:
        blocks.add_metric([model_name, str(row.rank), "used"], row.blocks_used)
        blocks.add_metric([model_name, str(row.rank), "reclaimable"], row.blocks_reclaimable)
        blocks.add_metric([model_name, str(row.rank), "free"], row.blocks_free)
    yield blocks
    yield per_rank(counter, "lmpool:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   lambda r: r.prompt_tokens)
    yield per_rank(counter, "lmpool:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                   lambda r: r.prefix_hit_tokens)
    yield per_rank(counter, "lmpool:prompt_tokens", "Prompt tokens admitted.", lambda r: r.prompt_tokens)
    yield per_rank(counter, "lmpool:generation_tokens", "Tokens generated.", lambda r: r.generated_tokens)
    yield pool(counter, "lmpool:kv_transfers", "KV transfer plans completed between ranks.",
               state.transfers_committed)
    yield pool(counter, "lmpool:kv_blocks_transferred", "KV blocks copied or moved by completed transfers.",
               state.blocks_transferred)
    yield per_rank(gauge, "lmpool:rank_up", "1 while the rank is alive and routable.", lambda r: int(r.alive))
    yield per_rank(gauge, "lmpool:heartbeat_age_seconds", "Time since the rank last reported.",
                   lambda r: r.heartbeat_age_s)
    yield pool(counter, "lmpool:route_queries", "Route decisions made by the control plane.", state.route_queries)
    yield from _route_latency(state, model_name)


def _route_latency(state: PoolState, model_name: str):
    """The control plane's route-decision histogram; none from a board without its buckets."""
    from prometheus_client.core import HistogramMetricFamily

    if len(state.route_latency_buckets) != len(ROUTE_LATENCY_BUCKETS_S):
        return
    buckets = [(repr(bound), count) for bound, count in zip(ROUTE_LATENCY_BUCKETS_S, state.route_latency_buckets)]
    family = HistogramMetricFamily("lmpool:route_latency_seconds", "Time the control plane took to route a request.",
                                   labels=["model_name"])
    family.add_metric([model_name], [*buckets, ("+Inf", state.route_queries)], state.route_latency_sum_s)
    yield family


def _usage(row) -> float:
    total = row.blocks_used + row.blocks_reclaimable + row.blocks_free
    return row.blocks_used / total if total else 0.0
