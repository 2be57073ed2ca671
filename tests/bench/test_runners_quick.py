"""Both evaluation runners in CPU quick mode: they finish, write the JSON the figures and
the paper runbook rely on, and ``plot_results.py`` draws every figure from it. Figures
(speed) are not asserted, only structure and the invariants of the records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_leaks(no_leaks):
    yield


def run(runner: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{runner}", "--quick", "--no-progress", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def check_common(data: dict, workloads: set[str], policies: set[str]) -> None:
    assert data["schema"] == "lmpool-eval/1"
    meta = data["metadata"]
    for key in ("command", "config", "model", "versions", "hardware", "git", "started_at", "finished_at",
                "dataset_profile", "mps"):
        assert key in meta, key
    assert meta["git"]["revision"] and meta["versions"]["torch"]
    assert meta["config"]["reps"] == 1 and meta["config"]["world_size"] == 2 and meta["config"]["block_size"] == 8
    assert set(meta["dataset_profile"]) == workloads
    assert set(data["policies"]) == policies
    assert all(not str(a).startswith("/") for a in meta["command"])  # no machine paths in the record
    ok = [r for r in data["runs"] if r["status"] == "ok"]
    for policy, state in data["policies"].items():
        runs = [r for r in data["runs"] if r["policy"] == policy]
        assert len(runs) == len(workloads)
        if state["status"] == "ok":
            assert all(r["status"] == "ok" for r in runs), [r["error"] for r in runs]
        else:
            assert state["error"]  # unavailable or failed policies say why
    for r in ok:
        cols = r["requests"]
        n = len(cols["index"])
        assert n == meta["dataset_profile"][r["workload"]]["requests"]
        assert cols["index"] == list(range(n))
        assert all(c == 4 for c in cols["output_len"])  # ignore_eos: exactly max_tokens
        assert all(0 <= rank < 2 for rank in cols["rank"])
        assert all(0 <= c <= p for c, p in zip(cols["num_cached_tokens"], cols["prompt_len"]))
        assert all(a <= f <= c for a, f, c in zip(cols["arrival_s"], cols["first_token_s"], cols["completion_s"]))
        pinned = [(p, k) for p, k in zip(cols["pinned_rank"], cols["rank"]) if p is not None]
        assert all(p == k for p, k in pinned)  # the workload's placement was honoured
        m = r["metrics"]
        assert sum(m["rank_requests"]) == n
        for key in ("throughput_tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms",
                    "e2e_mean_ms", "dp_req_hit", "dp_tok_reuse"):
            assert m[key] is not None and m[key] >= 0, key
        assert 0 <= m["dp_req_hit"] <= meta["dataset_profile"][r["workload"]]["trace_req_share"] + 1e-9
        # A run on a kept pool was reset, not started, and meets empty caches all the same.
        assert (r["reset_s"] if r.get("pool_reused") else r["start_s"]) > 0 and r["replay_s"] > 0
        assert cols["num_cached_tokens"][0] == 0
        count, total, longest = r["frontend_collect_ms"]  # the driver's own collections during the replay
        assert count >= 0 and 0 <= longest <= total and (count or total == 0)
        assert all(set(rank["loop_ms"]) >= {"admit", "launch", "read_back", "collect"} for rank in r["rank_stats"])
    for r in ok:
        entry = data["summary"][r["workload"]][r["policy"]]["throughput_tok_s"]
        assert entry["n"] == 1 and entry["half_width"] is None and entry["values"] == [r["metrics"]["throughput_tok_s"]]


def plots(path: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.plot_results", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.removeprefix("saved figure: ") for line in done.stdout.splitlines()]


def test_routing_runner_quick_mode(tiny_model, tmp_path):
    out = tmp_path / "eval_routing.json"
    run("benchmark_kv_routing", "--model", tiny_model, "--json", str(out), "--fresh-pools")
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kv_routing"
    assert data["metadata"]["pools"].startswith("fresh") and not any(r.get("pool_reused") for r in data["runs"])
    check_common(data, {"locality_1x", "locality_3x", "locality_5x"}, {"lmpool", "round_robin", "least_loaded"})
    assert all(r["status"] == "ok" for r in data["runs"])
    for record in data["runs"]:  # every request names the rule that routed it, without its figures
        routes = record["requests"]["route"]
        assert len(routes) == 192 and all(r and " " not in r for r in routes)
        if record["policy"] == "round_robin":
            assert set(routes) == {"round_robin"}
    profile = data["metadata"]["dataset_profile"]
    assert all(f"{100 * p['trace_req_share']:.2f}" == "91.67" for p in profile.values())
    acceptance = data["comparisons"]["acceptance"]
    assert acceptance["workload"] == "locality_5x"
    assert {"throughput_gain", "ttft_reduction", "peers_better_beyond_ci"} <= set(acceptance)
    assert plots(out) == [str(tmp_path / "eval_routing.png")]


def test_e2e_runner_quick_mode(tiny_model, tmp_path):
    out = tmp_path / "eval_e2e.json"
    run("benchmark_e2e", "--model", tiny_model, "--json", str(out))
    data = json.loads(out.read_text())
    assert data["benchmark"] == "e2e"
    check_common(data, {"load_skew", "memory_skew"},
                 {"round_robin", "least_loaded", "lmpool", "lmpool-routing", "lmpool+background", "lmpool+foreground"})
    for name in ("round_robin", "least_loaded", "lmpool", "lmpool-routing"):  # these exist in every build
        assert data["policies"][name]["status"] == "ok"
    for r in data["runs"]:
        if r["status"] == "ok" and r["policy"] in ("round_robin", "least_loaded", "lmpool-routing"):
            assert r["metrics"].get("blocks_moved", 0) == 0 and r["metrics"].get("blocks_copied", 0) == 0
    # One pool serves the runs whose workers it can serve (foreground release needs its own), reset
    # between them; every run still starts on empty caches (``check_common``).
    assert data["metadata"]["pools"].startswith("kept")
    ok = [r for r in data["runs"] if r["status"] == "ok"]
    assert all(bool(r.get("pool_reused")) != ("start_s" in r) for r in ok)
    assert any(r.get("pool_reused") for r in ok)
    assert not any(r.get("pool_reused") for r in ok if r["policy"] == "lmpool+foreground")
    mem = next(r for r in data["runs"] if r["workload"] == "memory_skew" and r["status"] == "ok")
    assert set(mem["metrics"]["phases"]) == {"warmup", "pressure", "reuse"}
    assert "met" in data["comparisons"]["acceptance"]
    assert plots(out) == [str(tmp_path / "eval_e2e_load_skew.png"), str(tmp_path / "eval_e2e_memory_skew.png")]


TRACE = "\n".join([
    "# two groups: one shares a spoken system prompt, the other a run of token ids",
    '{"prompt": "You are a careful assistant who answers questions about tides. Why two a day?", "phase": "warmup",'
    ' "group": "ocean"}',
    '{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], "phase": "warmup", "rank": 1}',
    "",
    '{"prompt": "You are a careful assistant who answers questions about tides. What is a neap tide?",'
    ' "phase": "revisit", "group": "ocean"}',
    '{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 99], "phase": "revisit"}',
]) + "\n"


@pytest.mark.parametrize("runner", ["benchmark_e2e", "benchmark_kv_routing"])
def test_a_trace_file_runs_alone_as_its_own_workload(tiny_model, tmp_path, runner):
    trace = tmp_path / "faq.jsonl"
    trace.write_text(TRACE)
    out = tmp_path / "eval_trace.json"
    run(runner, "--model", tiny_model, "--trace", str(trace), "--policies", "round_robin,lmpool", "--json", str(out))
    data = json.loads(out.read_text())
    check_common(data, {"trace_faq"}, {"round_robin", "lmpool"})
    profile = data["metadata"]["dataset_profile"]["trace_faq"]
    assert profile["params"]["file"] == "faq.jsonl" and profile["params"]["phases"] == ["warmup", "revisit"]
    assert profile["requests"] == 4 and profile["phases"]["revisit"]["requests_sharing"] == 2
    assert data["metadata"]["config"]["trace"] == ["<faq.jsonl>"]
    for record in data["runs"]:
        assert record["status"] == "ok"
        assert record["requests"]["pinned_rank"] == [None, 1, None, None]
    lmpool = next(r for r in data["runs"] if r["policy"] == "lmpool")
    assert lmpool["metrics"]["phases"]["revisit"]["dp_tok_reuse"] > 0  # the revisits found their prefixes
    assert plots(out) == [str(tmp_path / ("eval_trace_trace_faq.png" if runner == "benchmark_e2e"
                                           else "eval_trace.png"))]


def check_order_and_settings(data: dict) -> None:
    """Every repetition's order is recorded and is the Williams row; every run says its
    setting and its place in that order; every claim is counted."""
    from benchmarks.eval_suite import run_order

    names = list(data["policies"])
    assert data["metadata"]["config"]["order"] == "williams"
    assert data["metadata"]["config"]["cascade_min_saved"] == 0  # what CPU engines plan: none
    for rep, order in data["orders"].items():
        assert order == run_order(names, int(rep))
    for r in data["runs"]:
        assert data["orders"][str(r["rep"])][r["order_position"]] == r["policy"]
        assert data["settings"][r["workload"]] == {"workload": r["trace"], **r["setting"]}
    claims = data["comparisons"]["claims"]
    assert claims["count"] == claims["ahead"] + claims["level"] + claims["behind"]


def test_hot_context_runner_quick_mode_with_its_oracle(tiny_model, tmp_path):
    out = tmp_path / "eval_hot.json"
    run("benchmark_hot_context", "--model", tiny_model, "--json", str(out), "--contexts", "4096", "--hot", "2",
        "--questions", "16")
    data = json.loads(out.read_text())
    assert data["benchmark"] == "hot_context"
    check_common(data, {"hot_context_4k_2c", "hot_context_4k_2c_oracle"}, {"round_robin", "lmpool", "lmpool-routing"})
    check_order_and_settings(data)
    assert data["metadata"]["config"]["window"] == 0  # the burst arrives at once
    for r in data["runs"]:
        cols, oracle = r["requests"], r["trace"].endswith("_oracle")
        reads = [k for k, p in zip(cols["pinned_rank"], cols["phase"]) if p == "read"]
        assert reads == ([0, 1] * 1 if not oracle else [0, 1, 0, 1])  # owners, or every rank per context
        assert set(r["metrics"]["phases"]) == {"read", "burst"}
        assert r["metrics"]["routes"]["pinned"] == len(reads)
    acceptance = data["comparisons"]["acceptance"]["hot_context_4k_2c"]
    assert acceptance["oracle"] == "hot_context_4k_2c_oracle"
    assert acceptance["capture"]["burst/throughput_tok_s"]["best_routing_only"] in ("round_robin", "lmpool-routing")
    assert acceptance["setting"]["window"] == 0
    drawn = [str(tmp_path / f"eval_hot_{w}.png") for w in ("hot_context_4k_2c", "hot_context_4k_2c_oracle")]
    assert plots(out) == drawn


def test_the_oracle_runs_apart_with_fewer_policies_and_merges_with_the_real_trace(tiny_model, tmp_path):
    real, oracle, merged = (tmp_path / f"{name}.json" for name in ("real", "oracle", "merged"))
    common = ("--model", tiny_model, "--contexts", "4096", "--hot", "2", "--questions", "4", "--reps", "1")
    run("benchmark_hot_context", *common, "--json", str(real), "--no-oracle", "--policies", "round_robin,lmpool")
    run("benchmark_hot_context", *common, "--json", str(oracle), "--oracle-only", "--policies", "lmpool")
    assert set(json.loads(oracle.read_text())["summary"]) == {"hot_context_4k_2c_oracle"}
    subprocess.run([sys.executable, "-m", "benchmarks.merge_results", "-o", str(merged), str(real), str(oracle)],
                   check=True, capture_output=True, cwd=ROOT, timeout=120)
    capture = json.loads(merged.read_text())["comparisons"]["acceptance"]["hot_context_4k_2c"]["capture"]
    assert capture["burst/throughput_tok_s"]["oracle_best"] == "lmpool"  # the oracle's one policy
    assert set(capture["burst/throughput_tok_s"]["captured"]) == {"lmpool"}


def test_sessions_run_under_a_kv_budget_sweep(tiny_model, tmp_path):
    out = tmp_path / "eval_sessions.json"
    run("benchmark_e2e", "--model", tiny_model, "--json", str(out), "--workloads", "sessions",
        "--policies", "lmpool", "--sweep", "kv_budget=48,192")
    data = json.loads(out.read_text())
    keys = {"sessions@kv48_w16", "sessions@kv192_w16"}
    assert set(data["summary"]) == keys
    check_order_and_settings(data)
    assert {r["setting"]["kv_blocks_per_worker"] for r in data["runs"]} == {48, 192}
    for r in data["runs"]:
        assert r["status"] == "ok", r["error"]
        assert set(r["metrics"]["phases"]) == {f"turn{t}" for t in range(8)}
    reuse = {r["setting"]["kv_blocks_per_worker"]: r["metrics"]["dp_tok_reuse"] for r in data["runs"]}
    assert reuse[48] < reuse[192]  # a tighter budget evicts more of what the next turns need


def test_agent_sessions_and_chat_run_and_lmpool_s_routes_predict_their_ttft(tiny_model, tmp_path):
    out = tmp_path / "eval_chat.json"
    run("benchmark_e2e", "--model", tiny_model, "--json", str(out), "--workloads", "agent_sessions,chat",
        "--policies", "lmpool,sglang_cache_aware")
    data = json.loads(out.read_text())
    check_common(data, {"agent_sessions", "chat"}, {"lmpool", "sglang_cache_aware"})
    for r in data["runs"]:
        predicted = [p for p in r["requests"]["predicted_ttft_s"] if p is not None]
        assert all(x is not None and x >= 0 for x in r["requests"]["intake_s"])  # every hand-over's intake
        m = r["metrics"]
        if r["policy"] == "lmpool":  # every request priced, its prediction recorded and scored
            assert len(predicted) == m["requests"] == m["ttft_predicted_requests"] and all(p > 0 for p in predicted)
            assert 0 <= m["ttft_predicted_25pct"] <= 1
            assert m["ttft_predicted_ratio_p25"] <= m["ttft_predicted_ratio_p50"] <= m["ttft_predicted_ratio_p75"]
            assert 0 <= m["ttft_predicted_dispatched_25pct"] <= 1 and m["dispatch_mean_ms"] > 0
        else:
            assert predicted == [] and "ttft_predicted_25pct" not in m
