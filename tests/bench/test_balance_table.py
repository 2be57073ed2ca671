"""``benchmarks/balance_table.py``: co-runners, the E2E slope on them, and the phases' tails."""

from __future__ import annotations

import pytest

from benchmarks.balance_table import co_runners, rows, slope, tail_share


def test_co_runners_count_the_overlap_on_the_same_rank_only():
    # 0 and 1 share rank 0 for half of 0's life and all of 1's; 2 is alone on rank 1.
    got = co_runners([0.0, 1.0, 0.0], [2.0, 2.0, 2.0], [0, 0, 1])
    assert got == [0.5, 1.0, 0.0]


def test_a_phase_tail_is_the_done_ranks_wait_for_the_last():
    # Phase "a": rank 0 ends at 1, rank 1 at 4 (span 0-4, 2 ranks: 8); rank 0 waits 3, and
    # rank 2 (no request in the phase) waits 4. Phase "b" is even.
    share = tail_share([0, 0, 4, 4], [1, 4, 5, 5], [0, 1, 0, 1], ["a", "a", "b", "b"], world=3)
    assert share == pytest.approx((3 + 4 + 1) / (3 * 4 + 3 * 1))


def test_slope_recovers_a_line_and_is_zero_without_spread():
    assert slope([1, 2, 3], [0.2, 0.3, 0.4]) == pytest.approx(0.1)
    assert slope([2, 2], [1, 5]) == 0.0


def test_rows_pool_repetitions_and_leave_failed_requests_out():
    def run(policy, rep, completion):
        return {"policy": policy, "rep": rep, "status": "ok", "rank_stats": [{}, {}],
                "requests": {"arrival_s": [0.0, 0.0], "completion_s": completion, "rank": [0, 0],
                             "phase": ["p", "p"]}}
    data = {"runs": [run("x", 0, [1.0, 1.0]), run("x", 1, [1.0, None]),
                     {"policy": "x", "rep": 2, "status": "error", "requests": {}}]}
    r = rows(data)["x"]
    assert r["runs"] == 2 and r["requests"] == 3
    assert r["co_runners"] == pytest.approx(2 / 3)  # 1, 1 in the first run; 0 alone in the second
    assert r["tails"] == pytest.approx(0.5)  # rank 1 served nothing: idle all along, both runs
