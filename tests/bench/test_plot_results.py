"""``plot_results.py`` against the committed results: every committed figure has a JSON
that draws it (and nothing else is drawn), and the transfer counters are read as the
runs report them. (Byte-identical redraws depend on the matplotlib build; the results
notes record that check.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks import plot_results

RESULTS = Path(plot_results.__file__).resolve().parent / "results"


def test_every_committed_figure_redraws_from_its_json(tmp_path):
    sources = sorted(RESULTS.glob("eval_*.json"))
    assert sources, "no committed evaluation JSON"
    copies = [Path(shutil.copy(src, tmp_path / src.name)) for src in sources]
    drawn = {p.name for p in plot_results.main([str(c) for c in copies])}
    assert drawn == {p.name for p in RESULTS.glob("eval_*.png")}
    assert all((tmp_path / name).stat().st_size > 0 for name in drawn)


def run(policy: str, transfers: dict | None, status: str = "ok") -> dict:
    return {"workload": "w", "policy": policy, "rep": 0, "status": status, "transfers": transfers}


def test_counters_sum_gates_and_are_never_invented():
    data = {"runs": [run("a", {"placement_refused": {"cooldown": 3, "load_skew": 2}, "blocks_copied": 8}),
                     run("a", {"placement_refused": {}, "blocks_copied": 0}),
                     run("a", {"blocks_copied": 99}, status="failed"),
                     run("b", None)]}
    refused = plot_results._counter(data, "w", "a", "placement_refused")
    assert (refused["mean"], refused["n"]) == (2.5, 2)
    assert plot_results._counter(data, "w", "a", "blocks_copied")["mean"] == 4.0  # the failed run is left out
    assert plot_results._counter(data, "w", "b", "blocks_copied") is None  # not reported: no bar, not zero
    assert plot_results._counter(data, "w", "a", "lease_routed") is None
