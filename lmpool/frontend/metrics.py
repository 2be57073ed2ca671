"""Opt-in Prometheus metrics of a pool, served over HTTP from the user process.

Latency histograms are recorded where tokens reach the user process
(``PoolClient._deliver`` calls ``first_token``/``inter_token``). Every other figure is read,
at scrape time, from the pool-state board that the control process publishes, so the
exporter shows what ``lmpool top`` shows and adds no traffic to the pool.

Names follow the serving engines' conventions (vLLM's, under the ``lmpool:`` prefix);
per-rank series carry a ``rank`` label; token counters count tokens, not requests.

``prometheus_client`` is the ``metrics`` extra: it is imported only when a pool turns
metrics on. With metrics off the engine holds ``NO_METRICS``, whose hooks do nothing.
"""

from __future__ import annotations

from lmpool.protocol.state_board import PoolState, StateBoardReader
from lmpool_ipc import BoardBusyError

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class TokenTimer:
    """Where the engine reports token latencies; this base ignores them."""

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass


NO_METRICS = TokenTimer()


class MetricsServer(TokenTimer):
    """Records token latencies and serves ``/metrics`` for one pool until ``close``."""

    def __init__(self, board: str, port: int, host: str = "127.0.0.1") -> None:
        try:
            import prometheus_client
        except ImportError:
            raise ImportError(
                "metrics need prometheus-client: pip install 'lmpool[metrics]'"
            ) from None
        self.registry = prometheus_client.CollectorRegistry()
        self._ttft = prometheus_client.Histogram(
            "lmpool:time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self._itl = prometheus_client.Histogram(
            "lmpool:inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self._board = StateBoardReader(board)
        self.registry.register(_BoardCollector(self._board))
        try:
            self._server, self._thread = prometheus_client.start_http_server(port, host, self.registry)
        except BaseException:  # say, the port is taken
            self._board.close()
            raise
        self.port = self._server.server_port

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._board.close()


class _BoardCollector:
    """Turns the latest board state into metric families at each scrape."""

    def __init__(self, board: StateBoardReader) -> None:
        self._board = board

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            state = self._board.read()
        except BoardBusyError:
            state = None
        if state is None:  # nothing published yet: the latency histograms alone
            return
        yield from _pool_families(state, CounterMetricFamily, GaugeMetricFamily)


def _pool_families(state: PoolState, counter, gauge):
    def per_rank(family, value_of):
        for row in state.ranks:
            family.add_metric([str(row.rank)], value_of(row))
        return family

    yield per_rank(gauge("lmpool:num_requests_running", "Requests in the rank's running batch.", labels=["rank"]),
                   lambda r: r.num_running)
    yield per_rank(gauge("lmpool:num_requests_waiting", "Requests queued at the rank.", labels=["rank"]),
                   lambda r: r.num_waiting)
    yield per_rank(gauge("lmpool:kv_cache_usage_perc", "Fraction of the rank's KV blocks in use (1 = full).",
                         labels=["rank"]), _usage)
    blocks = gauge("lmpool:kv_cache_blocks", "The rank's KV blocks by state.", labels=["rank", "state"])
    for row in state.ranks:
        blocks.add_metric([str(row.rank), "used"], row.blocks_used)
        blocks.add_metric([str(row.rank), "reclaimable"], row.blocks_reclaimable)
        blocks.add_metric([str(row.rank), "free"], row.blocks_free)
    yield blocks
    yield per_rank(counter("lmpool:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           labels=["rank"]), lambda r: r.prompt_tokens)
    yield per_rank(counter("lmpool:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                           labels=["rank"]), lambda r: r.prefix_hit_tokens)
    yield per_rank(counter("lmpool:prompt_tokens", "Prompt tokens admitted.", labels=["rank"]),
                   lambda r: r.prompt_tokens)
    yield per_rank(counter("lmpool:generation_tokens", "Tokens generated.", labels=["rank"]),
                   lambda r: r.generated_tokens)
    yield counter("lmpool:kv_transfers", "KV transfer plans completed between ranks.", value=state.transfers_committed)
    yield counter("lmpool:kv_blocks_transferred", "KV blocks copied or moved by completed transfers.",
                  value=state.blocks_transferred)
    yield per_rank(gauge("lmpool:rank_up", "1 while the rank is alive and routable.", labels=["rank"]),
                   lambda r: int(r.alive))
    yield per_rank(gauge("lmpool:heartbeat_age_seconds", "Time since the rank last reported.", labels=["rank"]),
                   lambda r: r.heartbeat_age_s)
    yield counter("lmpool:route_queries", "Route decisions made by the control plane.", value=state.route_queries)
    latency = gauge("lmpool:route_latency_seconds", "Route decision time over recent decisions.", labels=["quantile"])
    latency.add_metric(["0.5"], state.route_p50_us / 1e6)
    latency.add_metric(["0.99"], state.route_p99_us / 1e6)
    yield latency


def _usage(row) -> float:
    total = row.blocks_used + row.blocks_reclaimable + row.blocks_free
    return row.blocks_used / total if total else 0.0
