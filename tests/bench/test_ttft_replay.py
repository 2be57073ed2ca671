"""The TTFT replay (``benchmarks/ttft_replay.py``) prices recorded requests against the state the
records show at their routes, with the pricing as it is."""

from __future__ import annotations

import pytest

from benchmarks.ttft_replay import main, replay_run
from lmpool.control.pricing.price import Limits

BLOCK = 16
FIT = {"base_ms": 2.0, "prefill_us_per_token": 30.0, "attention_ns_per_pair": 0.0, "decode_us_per_seq": 40.0,
       "context_us_per_token": 0.1}
LIMITS = Limits(BLOCK, 64, 8192)


def record(arrival: float, first: float, done: float, prompt: int, cached: int, route: str = "owner",
           predicted: float = 0.01) -> dict:
    return {"index": 0, "phase": "burst", "rank": 0, "arrival_s": arrival, "dispatch_s": 0.0,
            "first_token_s": first, "completion_s": done, "prompt_len": prompt, "num_cached_tokens": cached,
            "output_len": 8, "max_tokens": 8, "route": route, "predicted_ttft_s": predicted}


def run_of(rows: list[dict]) -> dict:
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    return {"workload": "w", "rep": 0, "policy": "lmpool", "requests": cols,
            "rank_stats": [{"rank": 0, "step_fit": FIT}]}


def test_a_request_on_an_idle_rank_is_priced_one_step_and_its_prefill():
    (ratio,) = replay_run(run_of([record(0.0, 0.1, 0.2, 5 * BLOCK + 1, 5 * BLOCK)]), LIMITS)
    step, prefill = 2e-3, 30e-6 * 1  # the last prompt token is computed
    assert ratio[0] == pytest.approx(0.01 / 0.1)
    assert ratio[1] == pytest.approx((step + prefill) / 0.1)


def test_a_request_behind_one_without_a_first_token_shares_its_step_and_waits_for_the_steps_under_way():
    rows = [record(0.0, 0.5, 0.9, 64, 0), record(0.01, 0.5, 0.9, 32, 0), record(0.02, 0.5, 0.9, 16, 0, "pull r0")]
    first, second = replay_run(run_of(rows), LIMITS)  # the pull-routed one is left out
    assert first[1] == pytest.approx((2e-3 + 30e-6 * 64) / 0.5)
    # The first is reserved there (its prompt as context): the two prefills packed into one step,
    # then the step under way and the next (overlapped stepping).
    step = 2e-3 + 40e-6 + 0.1e-6 * 64
    assert second[1] == pytest.approx((3 * step + 30e-6 * (64 + 32)) / 0.49)


def test_the_command_prints_each_run_s_shares(tmp_path, capsys):
    import json

    rows = [record(0.0, 0.1, 0.2, 64, 0), record(0.01, 0.2, 0.3, 64, 0)]
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": [run_of(rows) | {"status": "ok"}]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    main([str(path)])
    assert "w rep 0: 2 requests, within 25 %: recorded" in capsys.readouterr().out


def test_the_table_pools_each_workload_s_repetitions_and_gives_the_distribution(tmp_path, capsys):
    import json

    rows = [record(0.0, 0.1, 0.2, 64, 0, predicted=0.1), record(0.01, 0.2, 0.3, 64, 0, predicted=0.38)]
    runs = [run_of(rows) | {"status": "ok", "rep": rep} for rep in (0, 1)]
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": runs + [run_of(rows) | {"status": "failed", "rep": 2}]}
    path = tmp_path / "eval_x.json"
    path.write_text(json.dumps(data))
    main(["--table", str(path)])
    line = capsys.readouterr().out.splitlines()[-1]
    # Four priced requests: two priced exactly (1.0), two at twice their 0.19 s (outside 25 %).
    assert line.startswith("| `eval_x` | w | 4 | 0.50 |") and line.endswith("| 1.00 / 2.00 / 2.00 |")


def test_the_table_adds_the_step_fits_accuracy_by_kind_where_the_records_have_it(tmp_path, capsys):
    import json

    rows = [record(0.0, 0.1, 0.2, 64, 0, predicted=0.1)]
    kinds = [[{"kind": "decode", "steps": 30, "predicted_over_measured": 1.0, "within_25pct": 0.9}],
             [{"kind": "decode", "steps": 10, "predicted_over_measured": 0.5, "within_25pct": 0.1}]]
    run = run_of(rows) | {"status": "ok", "rank_stats": [{"rank": r, "step_fit": FIT | {"kinds": kinds[r]}}
                                                        for r in (0, 1)]}
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": [run]}
    path = tmp_path / "eval_y.json"
    path.write_text(json.dumps(data))
    main(["--table", str(path)])
    # The two ranks weighted by their steps: ratio exp((30 log 1 + 10 log 0.5) / 40), share 0.7.
    assert capsys.readouterr().out.splitlines()[-1] == "| `eval_y` | w | decode | 40 | 0.84 | 0.70 |"


def test_a_fit_record_gives_its_cascade_pair_and_one_from_before_it_had_one_the_attention_pair_s():
    """A record from before cascade pairs had a coefficient of their own priced them at the
    attention pair's: replayed so too."""
    from benchmarks.ttft_replay import coefficients

    old = FIT | {"attention_ns_per_pair": 7.0}
    assert coefficients(old).cascade_pair == pytest.approx(7e-9)
    assert coefficients(old | {"cascade_ns_per_pair": 15.0}).cascade_pair == pytest.approx(15e-9)


def test_the_places_table_orders_each_rank_s_requests_by_hand_over_and_splits_the_measured_time(tmp_path, capsys):
    """Five requests on rank 0 and one on rank 1: rank 0's first four in order of arrival plus
    hand-over (not of arrival) make the first row with rank 1's, its fifth the next; each row gives
    the parts' means and what they leave."""
    import json

    def timed(arrival, dispatch, first, rank=0, predicted=0.1):
        return record(arrival, first, first + 0.1, 64, 0, predicted=predicted) | {
            "rank": rank, "dispatch_s": dispatch, "intake_s": 0.002, "queued_s": 0.003, "first_step_s": 0.01}
    rows = [timed(0.0, 0.05, 0.1, predicted=0.1), timed(0.001, 0.001, 0.1), timed(0.002, 0.002, 0.1),
            timed(0.003, 0.003, 0.1), timed(0.004, 0.004, 0.1), timed(0.0, 0.001, 0.1, rank=1)]
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": [run_of(rows) | {"status": "ok"}]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    main(["--places", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| dispatch | intake | queued | first_step | rest |")
    first, second = lines[2].split(" | "), lines[3].split(" | ")
    # Rank 0's four handed over first and rank 1's one; rank 0's first arrival, handed over at 0.05 s, is 5th.
    assert first[1:6] == ["0-3", "5", "100", "98", "1.00"]  # priced, measured, within 25 %
    assert second[1:5] == ["4-7", "1", "100", "100"]
    # Measured 96-100 ms from arrival, of which 2 + 3 + 10 ms after the hand-over: the rest is what is left.
    parts = [float(x) for x in first[6:10]] + [float(first[10].rstrip(" |"))]
    assert parts[1:4] == [2, 3, 10] and sum(parts) == pytest.approx(98, abs=1.5)


def test_the_places_table_adds_the_price_s_busy_and_own_parts_where_the_routes_recorded_them(tmp_path, capsys):
    """A route's reason names two parts of its priced time (``price.describe``: the wait for the step
    under way and the request's own prefill); the places table gives their means beside the measured
    parts, and leaves them out for records from before they were recorded."""
    import json

    from lmpool.control.pricing.price import RankPrice, describe

    def timed(busy_ms, own_ms, arrival):
        price = RankPrice(0, 2, 16, 1, 10, 10, 1, 0.05, 0.2, 0, busy_s=busy_ms / 1e3, own_s=own_ms / 1e3)
        return record(arrival, arrival + 0.1, arrival + 0.2, 64, 32) | {
            "route_reason": describe("owner", price) + "; serve r0=200",  # as the evaluation's driver records it
            "intake_s": 0.002, "queued_s": 0.003, "first_step_s": 0.01}
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": [run_of([timed(10, 4, 0.0), timed(20, 6, 0.001)]) | {"status": "ok"}]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    main(["--places", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| rest | priced busy | priced own |")
    assert lines[2].split(" | ")[-2:] == ["15", "5 |"]
    data["runs"][0]["requests"]["route_reason"] = ["owner r0", "owner r0"]  # from before
    path.write_text(json.dumps(data))
    main(["--places", str(path)])
    assert capsys.readouterr().out.splitlines()[0].endswith("| rest |")


def test_a_pull_s_priced_parts_are_its_own_not_the_owner_s_it_overrode():
    """A pull's route record names its own price's parts before the owner's (after "over"); a
    record from before pulls named theirs has only the owner's, which are no parts of the pull."""
    from benchmarks.ttft_replay import priced_parts

    owner = "owner r0 m8 ttft=30.0ms price=90.0ms busy=12.0ms own=5.0ms"
    assert priced_parts(f"pull r1<-r0:8b=100 copy=3.0ms busy=1.0ms own=2.0ms over {owner}") == (0.001, 0.002)
    assert priced_parts(f"pull r1<-r0:8b=100 copy=3.0ms over {owner}") is None
    assert priced_parts(owner) == (0.012, 0.005)


def test_the_joiners_table_adds_the_own_prefill_of_later_requests_sharing_the_first_step(tmp_path, capsys):
    """Three requests on rank 0, routed 1 ms apart, all first tokens in one step at 40 ms: priced
    12, 20 and 38 ms against 40, 39 and 38 measured, only the last within 25 %. The later ones' own
    prefill (10 ms each) added makes the first two 32 and 30 ms: all three within. The forecast
    adds what was routed to the rank over the ``busy`` (5 ms) before each: 0, 10 and 20 ms, which
    brings the second within and the third past 125 %."""
    import json

    from lmpool.control.pricing.price import RankPrice, describe

    def timed(arrival, predicted):
        price = RankPrice(0, 2, 16, 1, 10, 10, 1, predicted, 0.2, 0, busy_s=0.005, own_s=0.01)
        return record(arrival, 0.04, 0.1, 64, 32, predicted=predicted) | {
            "route_reason": describe("owner", price) + "; serve r0=200"}
    data = {"metadata": {"config": {"block_size": BLOCK, "max_num_seqs": 64, "max_num_batched_tokens": 8192}},
            "runs": [run_of([timed(0.0, 0.012), timed(0.001, 0.02), timed(0.002, 0.038)]) | {"status": "ok"}]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    main(["--joiners", str(path)])
    row = capsys.readouterr().out.splitlines()[2].rstrip(" |").split(" | ")
    assert row[2:6] == ["3", "0.33", "1.00", "0.33"]  # requests; recorded, bound, forecast within 25 %
