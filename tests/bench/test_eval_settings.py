"""``benchmarks/replay/eval_settings.py`` and the runners' flags: sweeps parse into every
combination of their axes, bad ones are refused, and every setting has a label and a
record that name its budget, window, arrival process and order."""

from __future__ import annotations

import argparse

import pytest
from benchmarks.replay.eval_driver import Arrival
from benchmarks.replay.eval_settings import cell_key, parse_arrival, parse_sweep, settings, trace_of


def test_a_sweep_is_the_product_of_its_axes_with_plain_flags_for_the_rest():
    base = Arrival("window", 16, 0.0, seed=3)
    got = settings(192, base, parse_sweep(["kv_budget=96,192", "arrival=window,poisson:8"]))
    assert [s.label() for s in got] == ["kv96_w16", "kv96_w16_poisson8", "kv192_w16", "kv192_w16_poisson8"]
    assert all(s.arrival.seed == 3 for s in got)
    assert got[1].record("williams") == {"kv_blocks_per_worker": 96, "window": 16, "arrival": "poisson",
                                         "rate": 8.0, "order": "williams"}
    assert [s.label() for s in settings(96, base, {})] == ["kv96_w16"]
    windows = settings(96, base, parse_sweep(["window=16,64,0"]))
    assert [s.arrival.window for s in windows] == [16, 64, 0]


@pytest.mark.parametrize("spec, reason", [
    ("kv=1", "AXIS=V1"), ("kv_budget", "AXIS=V1"), ("kv_budget=0", ">= 1"), ("window=-1", ">= 0"),
    ("kv_budget=a", "integers"), ("arrival=burst", "an arrival is"), ("arrival=poisson:x", "requests/s"),
    ("kv_budget=", "at least one value"), ("window=16,16", "repeats"),
])
def test_bad_sweeps_are_refused(spec, reason):
    with pytest.raises(ValueError, match=reason):
        parse_sweep([spec])
    with pytest.raises(ValueError, match="given twice"):
        parse_sweep(["window=1", "window=2"])


def test_keys_carry_the_setting_only_in_a_sweep():
    (s,) = settings(96, Arrival("window", 0), {})
    assert cell_key("load_skew", s, swept=False) == "load_skew"
    assert cell_key("load_skew", s, swept=True) == "load_skew@kv96_w0"
    assert trace_of("load_skew@kv96_w0") == trace_of("load_skew") == "load_skew"
    assert parse_arrival("poisson:2.5") == ("poisson", 2.5) and parse_arrival("poisson", 4.0) == ("poisson", 4.0)


def parsed(*flags: str) -> argparse.Namespace:
    from benchmarks import eval_suite

    ap = argparse.ArgumentParser()
    eval_suite.add_arguments(ap)
    return eval_suite.finish_arguments(ap.parse_args(["--quick", *flags]), 384, "e2e")


def test_the_runner_flags_build_the_settings_and_default_to_the_williams_order():
    args = parsed("--sweep", "kv_budget=24,48", "--arrival", "poisson:50", "--window", "0")
    assert args.order == "williams"
    assert [s.label() for s in args.settings] == ["kv24_w0_poisson50", "kv48_w0_poisson50"]
    assert parsed().settings[0].label() == "kv192_w16"  # 384 blocks over 2 quick replicas
    assert parsed("--order", "fixed").order == "fixed"
    with pytest.raises(SystemExit, match="rate > 0"):
        parsed("--arrival", "poisson")
    with pytest.raises(SystemExit, match="AXIS"):
        parsed("--sweep", "budget=1")


def test_a_run_writes_the_committed_results_only_when_its_json_names_them(tmp_path):
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    default = parsed().json
    assert default.name == "eval_cpu_quick_e2e.json" and results not in default.parents
    assert parsed("--json", str(tmp_path / "x.json")).json == tmp_path / "x.json"
