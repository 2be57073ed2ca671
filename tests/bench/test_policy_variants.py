"""Evaluation policies that vary LMPool's own routing settings: they reach the pool as a
``RoutingConfig``, and the acceptance never counts them as peers of LMPool."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import benchmark_kv_routing  # noqa: E402
from eval_suite import LMPOOL, LMPOOL_VARIANTS, Policy  # noqa: E402


def test_a_variant_passes_its_routing_config_and_a_plain_policy_passes_none():
    (without,) = [p for p in LMPOOL_VARIANTS if p.name == "lmpool-pending"]
    kw = without.pool_kwargs()
    assert kw["routing"] == "lmpool" and kw["routing_config"].pending_ttl_s == 0.0
    assert LMPOOL.pool_kwargs() == {"routing": "lmpool"}
    assert Policy("x", "lmpool", "background").pool_kwargs() == {"routing": "lmpool", "transfer_mode": "background"}


def change(separation: str) -> dict:
    return {"relative_change": {"mean": 0.1, "low": 0.05, "high": 0.15, "n": 3}, "separation": separation}


def test_lmpool_variants_are_not_peers_in_the_acceptance(monkeypatch):
    def paired(by_policy, base, peer, metric):
        return change("worse" if peer in ("lmpool-pending", "sglang_cache_aware") else "better")

    monkeypatch.setattr(benchmark_kv_routing, "paired_change", paired)
    summary = {"locality_5x": {p: {} for p in ("lmpool", "round_robin", "sglang_cache_aware", "lmpool-pending")}}
    acceptance = benchmark_kv_routing.comparisons(summary)["acceptance"]
    assert acceptance["peers_better_beyond_ci"] == [
        "sglang_cache_aware:e2e_mean_ms", "sglang_cache_aware:throughput_tok_s", "sglang_cache_aware:ttft_mean_ms"]
