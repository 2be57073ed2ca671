"""``benchmarks/merge_results.py``: parts of one suite merge into the JSON one run would
have written; parts that measured different things are refused."""

from __future__ import annotations

import pytest
from benchmarks.merge_results import merge


def part(policy: str, reps: list[int], tput: float, status: str = "ok", **config) -> dict:
    runs = [{"workload": "locality_5x", "policy": policy, "rep": r, "status": "ok", "error": None,
             "metrics": {"throughput_tok_s": tput + r, "ttft_mean_ms": 100.0 - r, "phases": {}}} for r in reps]
    return {
        "schema": "lmpool-eval/1", "benchmark": "kv_routing",
        "metadata": {"model": {"name": "m"}, "config": {"block_size": 256, "scale": 1.0, **config},
                     "dataset_profile": {"locality_5x": {"requests": 192}}},
        "policies": {policy: {"routing": policy, "transfer_mode": "none", "status": status, "error": None}},
        "runs": runs,
    }


def test_parts_merge_and_the_summary_is_recomputed():
    merged = merge([part("lmpool", [0, 1, 2], 150.0), part("round_robin", [0, 1], 100.0),
                    part("round_robin", [2], 100.0)])
    assert [(r["policy"], r["rep"]) for r in merged["runs"]] == [
        ("lmpool", 0), ("round_robin", 0), ("lmpool", 1), ("round_robin", 1), ("lmpool", 2), ("round_robin", 2)]
    assert set(merged["policies"]) == {"lmpool", "round_robin"}
    assert merged["summary"]["locality_5x"]["round_robin"]["throughput_tok_s"]["n"] == 3
    gain = merged["comparisons"]["acceptance"]["throughput_gain"]
    assert gain["n"] == 3 and gain["mean"] == pytest.approx(sum(0.5 / (1 + r / 100) for r in range(3)) / 3)
    assert len(merged["metadata"]["merged_from"]) == 3


def test_overlapping_or_mismatched_parts_are_refused():
    with pytest.raises(ValueError, match="two parts hold"):
        merge([part("lmpool", [0, 1], 1.0), part("lmpool", [1], 1.0)])
    with pytest.raises(ValueError, match=r"differs from part 0 in \['scale'\]"):
        merge([part("lmpool", [0], 1.0), part("round_robin", [0], 1.0, scale=0.5)])


def test_a_failed_part_marks_its_policy():
    merged = merge([part("lmpool", [0], 1.0), part("lmpool", [1], 1.0, status="failed")])
    assert merged["policies"]["lmpool"]["status"] == "failed"


def test_revisions_are_listed_and_a_mix_is_warned_about(capsys):
    a, b = part("lmpool", [0], 1.0), part("round_robin", [0], 1.0)
    a["metadata"]["git"] = b["metadata"]["git"] = {"revision": "abc", "dirty": False}
    assert merge([a, b])["metadata"]["revisions"] == ["abc"]
    assert capsys.readouterr().err == ""
    b["metadata"]["git"] = {"revision": "def", "dirty": None, "source": "LMPOOL_GIT_REVISION"}
    assert merge([a, b])["metadata"]["revisions"] == ["abc", "def"]
    assert "different revisions ['abc', 'def']" in capsys.readouterr().err


def test_an_early_stop_shows_only_while_another_part_has_not_run_the_rest():
    def asked(p: dict, first: int, count: int) -> dict:
        p["metadata"]["config"].update(first_rep=first, reps=count)
        return p

    first = asked(part("lmpool", [0], 1.0), 0, 3)
    first["stopped_early"] = "after 1 repetitions: another would end past --max-minutes 3.0"
    assert "stopped_early" not in merge([first, asked(part("lmpool", [1, 2], 1.0), 1, 2)])
    assert merge([first, asked(part("lmpool", [1], 1.0), 1, 1)])["stopped_early"] == (
        "after 1 repetitions: another would end past --max-minutes 3.0 (repetitions [2] not run)")


def swept(policy: str, key: str, setting: dict, reps: list[int]) -> dict:
    p = part(policy, reps, 100.0)
    for run in p["runs"]:
        run["workload"] = key
    p["metadata"]["dataset_profile"] = {"locality_5x": {"requests": 192}}
    p["settings"] = {key: {"workload": "locality_5x", **setting}}
    p["orders"] = {str(r): [policy] for r in reps}
    return p


def test_parts_may_split_a_sweep_but_not_run_one_key_under_two_settings():
    small = {"kv_blocks_per_worker": 96, "window": 16, "arrival": "window", "rate": None, "order": "williams"}
    large = dict(small, kv_blocks_per_worker=384)
    a = swept("lmpool", "locality_5x@kv96_w16", small, [0, 1])
    b = swept("lmpool", "locality_5x@kv384_w16", large, [0, 1])
    a["metadata"]["config"]["num_kv_blocks"], b["metadata"]["config"]["num_kv_blocks"] = 96, 384
    merged = merge([a, b])
    assert set(merged["settings"]) == {"locality_5x@kv96_w16", "locality_5x@kv384_w16"}
    assert merged["part_orders"] == [{"0": ["lmpool"], "1": ["lmpool"]}] * 2 and "orders" not in merged
    assert merged["comparisons"]["settings"] == merged["settings"]
    clash = swept("round_robin", "locality_5x@kv96_w16", large, [0])
    with pytest.raises(ValueError, match="ran locality_5x@kv96_w16 under"):
        merge([a, clash])
    old = part("round_robin", [0], 1.0, num_kv_blocks=384)  # no recorded settings: the flags must agree
    with pytest.raises(ValueError, match="num_kv_blocks"):
        merge([part("lmpool", [0], 1.0, num_kv_blocks=96), old])
