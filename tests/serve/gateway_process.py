"""SGLang's model gateway (``smg``, its pip package's binary) as a process in front of test hosts,
HTTP or gRPC workers alike; its worker listing and Prometheus series, read as the tests wait on them."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import httpx
from serve_process import free_port, smg_binary, terminate, wait_for

from benchmarks.lib.prometheus import series_sum


# smg's warm-up slice sends one cache miss in four, and its divert one cache hit in eight, to a
# worker whose index is thin against the fleet's, whatever the request's overlap elsewhere; which
# requests those are depends on the index's state at its last rebuild (every second). The tests
# assert where cache-aware routes go, so they switch both off (a zero share switches off both).
WARMUP_OFF = ("--worker-warmup-share", "0")
# The branches of smg's event-driven cache-aware decision (smg_cache_aware_policy_branch_total).
BRANCHES = ("event_hit", "event_miss", "event_spill", "warmup_slice", "warmup_divert")


class Gateway:
    def __init__(self, workers: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *workers,
             "--policy", "cache_aware", *WARMUP_OFF, "--prometheus-port", self.metrics_url.rsplit(":", 1)[1],
             "--prometheus-host", "127.0.0.1",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def serves(self, model: str) -> bool:
        assert self.proc.poll() is None, "the gateway exited"
        try:
            models = httpx.get(f"{self.url}/v1/models", timeout=10).json()
        except (httpx.TransportError, ValueError):
            return False
        return any(card.get("id") == model for card in models.get("data", []))

    def workers(self) -> dict[str, dict]:
        """The gateway's worker listing, by URL."""
        return {w["url"]: w for w in httpx.get(f"{self.url}/workers", timeout=10).json()["workers"]}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the gateway's series of ``name`` whose labels include ``labels``."""
        return series_sum(httpx.get(f"{self.metrics_url}/metrics", timeout=10).text, name, **labels)

    def branches(self) -> dict[str, float]:
        """How many requests each branch of the cache-aware decision has routed."""
        return {b: self.metric("smg_cache_aware_policy_branch_total", branch=b) for b in BRANCHES}

    def stop(self) -> None:
        terminate(self.proc, 30)
        self._log.close()


@contextlib.contextmanager
def gateway_over(servers: list, workers: list[str], log: Path, model: str = "tiny"):
    """A gateway in front of ``servers`` (at ``workers``, their URLs), once it serves ``model``
    from all of them; stopped with the servers at the end."""
    try:
        gateway = Gateway(workers, log)
        try:
            wait_for(lambda: gateway.serves(model) and len(gateway.workers()) == len(workers),
                     "the gateway's registration of the hosts")
            yield gateway
        finally:
            gateway.stop()
    finally:
        for server in servers:
            server.stop()
