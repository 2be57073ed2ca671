"""``benchmarks/stats/claims.py`` and the policy order: every claim is listed once with its setting
and counted; a fixed order is only what was asked for."""

from __future__ import annotations

from benchmarks.stats import claims
from benchmarks.stats.eval_metrics import paired_change, summarize
from benchmarks.stats.policy_order import balanced_repetitions, policy_order, run_order


def fake_run(workload: str, policy: str, rep: int, tput: float) -> dict:
    return {"workload": workload, "policy": policy, "rep": rep, "status": "ok",
            "metrics": {"throughput_tok_s": tput, "ttft_mean_ms": 100.0 + rep, "phases": {}}}


def compare(summary: dict) -> dict:
    return {w: {"rr": {m: paired_change(s, "lm", "rr", m) for m in ("throughput_tok_s", "ttft_mean_ms")}}
            for w, s in summary.items()}


def test_every_claim_is_listed_with_its_setting_and_counted():
    runs = [fake_run(w, p, r, base + (10 if p == "lm" else 0) + r * (1 + (p == "lm") * 0.1))
            for w, base in (("locality_5x@kv96_w16", 100.0), ("locality_5x@kv384_w16", 200.0))
            for p in ("lm", "rr") for r in range(3)]
    summary = summarize(runs)
    settings = {w: {"workload": "locality_5x", "kv_blocks_per_worker": kv, "window": 16, "arrival": "window",
                    "rate": None, "order": "williams"}
                for w, kv in (("locality_5x@kv96_w16", 96), ("locality_5x@kv384_w16", 384), ("unrun@x", 1))}
    out = claims.finish(compare, summary, settings)
    assert set(out["settings"]) == {"locality_5x@kv96_w16", "locality_5x@kv384_w16"}  # only what ran
    table = out["claims"]
    assert table["count"] == 4 and table["ahead"] == 2 and table["level"] == 2 and table["behind"] == 0
    rows = {(r["workload"], r["path"].split("/")[-1]): r for r in table["rows"]}
    tput = rows[("locality_5x@kv96_w16", "throughput_tok_s")]
    assert tput["claim"] == "ahead" and tput["n"] == 3 and tput["setting"]["kv_blocks_per_worker"] == 96
    assert rows[("locality_5x@kv384_w16", "ttft_mean_ms")]["claim"] == "level"  # identical TTFTs


def test_a_headline_block_says_its_setting():
    summary = summarize([fake_run("w", p, r, 1.0 + r) for p in ("lm", "rr") for r in range(2)])
    setting = {"workload": "w", "kv_blocks_per_worker": 8, "window": 0, "arrival": "window", "rate": None,
               "order": "williams"}
    out = claims.finish(lambda s: {"acceptance": {"workload": "w"}}, summary, {"w": setting})
    assert out["acceptance"]["setting"] == setting and out["claims"]["count"] == 0


def test_fixed_order_is_as_listed_and_williams_is_the_design_row():
    names = ["a", "b", "c"]
    assert [policy_order(names, rep, "fixed") for rep in range(3)] == [names] * 3
    assert [policy_order(names, rep, "williams") for rep in range(6)] == [run_order(names, rep) for rep in range(6)]
    assert balanced_repetitions(6) == 6 and balanced_repetitions(7) == 14 and balanced_repetitions(1) == 1


def test_the_claims_table_reads_old_results_by_todays_rule():
    """A committed result without recorded settings or order: its rows say the budget and
    window from its config, "order not recorded", and a verdict from the paired interval."""
    from pathlib import Path

    from benchmarks import claims_table

    path = Path(claims_table.__file__).resolve().parent / "results" / "eval_h200_0.6b_kv_routing.json"
    lines = claims_table.main([str(path)])
    rows = [line for line in lines if line.startswith("| eval_")]
    assert len(rows) == 4  # LMPool against the four peers it ran with
    assert all("192 blocks/worker, window 16, closed loop, order not recorded" in row for row in rows)
    sglang = next(row for row in rows if "vs sglang_cache_aware" in row)
    assert sglang.count("level") == 3
    assert lines[-1].strip().startswith("12 claims")
