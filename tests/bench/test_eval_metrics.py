"""``benchmarks/stats/eval_metrics.py``: per-run metrics by their definitions, absent transfer
counters stay absent, and aggregation / comparison across repetitions, whose claims rest on
the paired differences' interval."""

from __future__ import annotations

import pytest
from benchmarks.stats.eval_metrics import RECORD_FIELDS, claim, paired_change, run_metrics, summarize
from benchmarks.stats.student_t import confidence_interval


def columns(rows: list[dict]) -> dict[str, list]:
    base = {"phase": "main", "group": "g", "max_tokens": 4, "pinned_rank": None}
    full = [{**base, "index": i, **r} for i, r in enumerate(rows)]
    return {f: [r[f] for r in full] for f in RECORD_FIELDS}


ROWS = [
    # arrival 0, first token 0.1 s, done 0.4 s, 4 tokens: TPOT 0.1 s
    {"prompt_len": 100, "rank": 0, "num_cached_tokens": 64, "output_len": 4,
     "arrival_s": 0.0, "first_token_s": 0.1, "completion_s": 0.4},
    # a single output token has no decode interval: no TPOT
    {"prompt_len": 50, "rank": 1, "num_cached_tokens": 0, "output_len": 1,
     "arrival_s": 0.2, "first_token_s": 0.5, "completion_s": 0.5},
    {"prompt_len": 50, "rank": 1, "num_cached_tokens": 32, "output_len": 3,
     "arrival_s": 0.3, "first_token_s": 0.6, "completion_s": 1.0},
]


def test_run_metrics_follow_the_definitions():
    m = run_metrics(columns(ROWS), None, world_size=2)
    assert m["requests"] == 3 and m["output_tokens"] == 8 and m["prompt_tokens"] == 200
    assert m["duration_s"] == pytest.approx(1.0)
    assert m["throughput_tok_s"] == pytest.approx(8.0)
    assert m["ttft_mean_ms"] == pytest.approx((100 + 300 + 300) / 3)
    assert m["tpot_mean_ms"] == pytest.approx((100 + 200) / 2)  # (0.4-0.1)/3 and (1.0-0.6)/2
    assert m["e2e_mean_ms"] == pytest.approx((400 + 300 + 700) / 3)
    assert m["dp_req_hit"] == pytest.approx(2 / 3)
    assert m["dp_tok_reuse"] == pytest.approx(96 / 200)
    assert m["rank_requests"] == [1, 2] and m["rank_imbalance"] == pytest.approx(2 / 1.5)
    assert m["phases"] == {}  # one phase: nothing to break down


def test_missing_transfer_counters_are_absent_not_zero():
    m = run_metrics(columns(ROWS), {"plans_committed": 2, "blocks_moved": 0}, world_size=2)
    assert m["plans_committed"] == 2 and m["blocks_moved"] == 0
    assert "lease_routed" not in m and "blocks_copied" not in m
    assert "plans_committed" not in run_metrics(columns(ROWS), None, world_size=2)


def test_phases_are_broken_down():
    rows = [dict(r) for r in ROWS]
    rows[0]["phase"] = "warmup"
    cols = columns(rows)
    cols["phase"] = ["warmup", "reuse", "reuse"]
    m = run_metrics(cols, None, world_size=2)
    assert set(m["phases"]) == {"warmup", "reuse"}
    assert m["phases"]["reuse"]["ttft_mean_ms"] == pytest.approx(300)


def fake_run(policy: str, rep: int, tput: float, ttft: float, status: str = "ok") -> dict:
    return {"workload": "w", "policy": policy, "rep": rep, "status": status,
            "metrics": {"throughput_tok_s": tput, "ttft_mean_ms": ttft, "tpot_mean_ms": None, "phases": {}}}


def test_summary_uses_completed_runs_and_comparisons_pair_by_repetition():
    runs = [fake_run("a", 0, 110, 50), fake_run("a", 1, 120, 52), fake_run("a", 2, 130, 51),
            fake_run("b", 0, 100, 80), fake_run("b", 1, 100, 82), fake_run("b", 2, 0, 0, status="failed")]
    s = summarize(runs)["w"]
    assert s["a"]["throughput_tok_s"]["n"] == 3 and s["b"]["throughput_tok_s"]["n"] == 2
    assert "tpot_mean_ms" not in s["a"]  # undefined figures are not averaged as zeros
    change = paired_change(s, "a", "b", "throughput_tok_s")
    assert change["relative_change"]["values"] == pytest.approx([0.1, 0.2])  # rep 2 has no pair
    assert change["higher_is_better"] is True
    assert change["difference"]["values"] == pytest.approx([10.0, 20.0])
    ttft = paired_change(s, "a", "b", "ttft_mean_ms")
    assert ttft["claim"] == "ahead"  # a's TTFT is 30 ms lower in both paired repetitions
    assert paired_change(s, "a", "missing", "ttft_mean_ms") is None


def test_the_claim_follows_the_paired_difference_not_the_overlap_of_the_two_intervals():
    """Two policies whose own intervals overlap widely, while every repetition puts one ahead
    by about the same amount: the paired interval says ahead. A repetition effect (a faster
    machine for rep 2) moves both alike and is paired away."""
    a_vals, b_vals = [100.0, 110.0, 150.0], [95.0, 104.0, 146.0]
    runs = [fake_run(p, r, v, 50) for p, vals in (("a", a_vals), ("b", b_vals)) for r, v in enumerate(vals)]
    s = summarize(runs)["w"]
    own_a, own_b = s["a"]["throughput_tok_s"], s["b"]["throughput_tok_s"]
    assert own_a["low"] < own_b["high"]  # the old rule would have said "overlap"
    change = paired_change(s, "a", "b", "throughput_tok_s")
    assert change["difference"]["mean"] == pytest.approx(5.0) and change["difference"]["low"] > 0
    assert change["claim"] == "ahead"
    assert paired_change(s, "b", "a", "throughput_tok_s")["claim"] == "behind"
    assert paired_change(s, "a", "b", "ttft_mean_ms")["claim"] == "level"  # identical: the interval is [0, 0]


def test_claims_respect_the_metric_direction_and_need_an_interval():
    lower = confidence_interval([-3.0, -2.0, -4.0])  # candidate minus baseline, wholly below zero
    assert claim(lower, higher_is_better=True) == "behind"
    assert claim(lower, higher_is_better=False) == "ahead"  # e.g. TTFT: lower is better
    assert claim(confidence_interval([-1.0, 2.0, 0.5]), True) == "level"
    assert claim(confidence_interval([1.0]), True) is None
