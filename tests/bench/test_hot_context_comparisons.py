"""The hot-context runner's comparisons on a hand-made summary: the oracle's gain over the
best routing-only policy, the share of it a transfer-moving policy captures, and the
paired verdicts behind "ahead of every routing-only policy"."""

from __future__ import annotations

import pytest
from benchmarks.benchmark_hot_context import comparisons, oracle_key
from benchmarks.stats.eval_metrics import summarize


def run(key: str, policy: str, rep: int, tput: float, ttft: float, e2e: float) -> dict:
    phases = {"burst": {"throughput_tok_s": tput, "ttft_mean_ms": ttft, "e2e_mean_ms": e2e}}
    return {"workload": key, "policy": policy, "rep": rep, "status": "ok",
            "metrics": {"throughput_tok_s": tput, "ttft_mean_ms": ttft, "e2e_mean_ms": e2e, "phases": phases}}


# Burst throughput per policy (3 repetitions, +r each): round robin is the best routing-only
# policy at 100; the oracle reaches 210 under LMPool's default; lmpool+both reaches 170: 70 % of the gain.
REAL = {"round_robin": 100.0, "lmpool-routing": 80.0, "sglang_cache_aware": 90.0, "lmpool+both": 170.0}
ORACLE = {"round_robin": 200.0, "lmpool": 210.0}


def summary() -> dict:
    key = "hot_context_16k_2c"
    runs = [run(key, p, r, v + r, 1000.0 / v, 500.0) for p, v in REAL.items() for r in range(3)]
    runs += [run(oracle_key(key), p, r, v + r, 1000.0 / v, 400.0) for p, v in ORACLE.items() for r in range(3)]
    return summarize(runs)


def test_the_oracle_gain_and_its_capture():
    acceptance = comparisons(summary())["acceptance"]
    assert set(acceptance) == {"hot_context_16k_2c"}  # oracle traces get no acceptance of their own
    acc = acceptance["hot_context_16k_2c"]
    tput = acc["capture"]["burst/throughput_tok_s"]
    assert (tput["best_routing_only"], tput["oracle_best"]) == ("round_robin", "lmpool")
    assert tput["oracle_gain"] == pytest.approx((211 - 101) / 101)
    assert tput["captured"] == {"lmpool+both": pytest.approx((171 - 101) / (211 - 101))}
    ttft = acc["capture"]["burst/ttft_mean_ms"]  # lower is better: the same policies, the same share
    assert ttft["best_routing_only"] == "round_robin" and ttft["captured"]["lmpool+both"] > 0
    both = acc["candidates"]["lmpool+both"]
    assert both["ahead_of_every_routing_only"] is True and both["behind_on_e2e"] == []
    assert "lmpool-routing" not in acc["candidates"]  # routing only is a baseline here, not a candidate
    assert acc["oracle_lmpool_vs_round_robin"] == "ahead"


def test_keys_with_a_setting_find_their_oracle():
    assert oracle_key("hot_context_4k_1c@kv512_w0_poisson16") == "hot_context_4k_1c_oracle@kv512_w0_poisson16"
    assert oracle_key("hot_context_4k_1c") == "hot_context_4k_1c_oracle"
