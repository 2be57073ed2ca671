"""Metrics of one benchmark run, their aggregation across repetitions, and comparisons.

A run's per-request records are columns (one list per field, one entry per request, in
trace order); times are seconds from the run's first submission. Definitions (see
``benchmarks/README.md``):

- throughput: output tokens / (last completion - first arrival);
- TTFT: first token - arrival; E2E: completion - arrival;
- TPOT: (completion - first token) / (N - 1), for requests with N > 1 output tokens;
- DP req hit: requests with ``num_cached_tokens > 0`` / requests;
- DP tok reuse: sum of ``num_cached_tokens`` / sum of prompt tokens;
- TTFT prediction (LMPool's priced routes): the share of requests whose route predicted
  their TTFT within 25%, and the quartiles of predicted / measured.

Transfer counters come from the pool's ``stats()["transfers"]``; a counter the pool does
not report is left out, never read as zero. Aggregates use only runs that completed; a
comparison between two policies pairs them by repetition and uses the repetitions where
both completed; its claim (ahead / level / behind) rests on the 95% interval of the paired
differences, never on whether the two policies' own intervals overlap. Intervals are
two-sided 95% Student-t (``student_t``).
"""

from __future__ import annotations

from collections import Counter

from benchmarks.stats.student_t import confidence_interval, mean, percentile

RECORD_FIELDS = (
    "index", "phase", "group", "prompt_len", "max_tokens", "pinned_rank", "rank",
    "num_cached_tokens", "output_len", "arrival_s", "first_token_s", "completion_s",
)
# Recorded since a later revision; older results lack them, and no metric needs them.
OPTIONAL_FIELDS = ("route", "route_reason", "predicted_ttft_s", "dispatch_s", "intake_s", "queued_s",
                   "first_step_s")
TRANSFER_COUNTERS = (
    "plans_started", "plans_committed", "plans_aborted", "blocks_copied", "blocks_moved", "lease_routed",
)
# (metric, higher is better) for the comparisons and the figures.
HEADLINE = {
    "throughput_tok_s": True, "ttft_mean_ms": False, "ttft_p50_ms": False, "ttft_p99_ms": False,
    "tpot_mean_ms": False, "e2e_mean_ms": False, "e2e_p99_ms": False, "dp_req_hit": True, "dp_tok_reuse": True,
}


def _latency(prefix: str, values_s: list[float]) -> dict:
    if not values_s:
        return {}
    ms = [v * 1e3 for v in values_s]
    return {f"{prefix}_mean_ms": mean(ms), f"{prefix}_p50_ms": percentile(ms, 50),
            f"{prefix}_p99_ms": percentile(ms, 99)}


def _request_metrics(rows: list[dict]) -> dict:
    ttft = [r["first_token_s"] - r["arrival_s"] for r in rows]
    e2e = [r["completion_s"] - r["arrival_s"] for r in rows]
    tpot = [(r["completion_s"] - r["first_token_s"]) / (r["output_len"] - 1) for r in rows if r["output_len"] > 1]
    out_tokens = sum(r["output_len"] for r in rows)
    prompt_tokens = sum(r["prompt_len"] for r in rows)
    duration = max(r["completion_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    m = {
        "requests": len(rows), "output_tokens": out_tokens, "prompt_tokens": prompt_tokens, "duration_s": duration,
        "throughput_tok_s": out_tokens / duration if duration > 0 else None,
        "request_rate": len(rows) / duration if duration > 0 else None,
        "dp_req_hit": sum(r["num_cached_tokens"] > 0 for r in rows) / len(rows),
        "dp_tok_reuse": sum(r["num_cached_tokens"] for r in rows) / prompt_tokens,
    }
    m.update(_latency("ttft", ttft))
    m.update(_latency("tpot", tpot))
    m.update(_latency("e2e", e2e))
    return m


def rows_of(columns: dict[str, list]) -> list[dict]:
    n = len(columns["index"])
    return [{f: columns[f][i] for f in RECORD_FIELDS} for i in range(n)]


def run_metrics(columns: dict[str, list], transfers: dict | None, world_size: int) -> dict:
    """Scalar metrics of one completed run (``None`` where a figure is undefined), plus
    ``phases`` (the request metrics of each phase) and ``rank_requests``."""
    rows = rows_of(columns)
    if not rows:
        raise ValueError("a run without requests has no metrics")
    m = _request_metrics(rows)
    per_rank = Counter(r["rank"] for r in rows if r["rank"] is not None)
    m["rank_requests"] = [per_rank.get(k, 0) for k in range(world_size)]
    m["rank_imbalance"] = max(m["rank_requests"]) / (len(rows) / world_size) if per_rank else None
    phases: dict[str, list[dict]] = {}
    for r in rows:
        phases.setdefault(r["phase"], []).append(r)
    m["phases"] = {name: _request_metrics(p) for name, p in phases.items()} if len(phases) > 1 else {}
    routes = [r.split(" ", 1)[0] for r in columns.get("route") or [] if r]
    if routes:  # which rule routed how many requests: is a peer's balancing path ever taken?
        m["routes"] = dict(sorted(Counter(routes).items()))
    m.update(ttft_prediction(rows, columns.get("predicted_ttft_s"), columns.get("dispatch_s")))
    for key in TRANSFER_COUNTERS:
        if transfers is not None and key in transfers:
            m[key] = transfers[key]
    return m


def ttft_prediction(rows: list[dict], predicted: list | None, dispatch: list | None = None) -> dict:
    """How well the route's predicted time to first token matched the measured one, over the
    requests a pricing policy routed: the share within 25% (``ttft_predicted_25pct``), and the
    quartiles of predicted / measured (``ttft_predicted_ratio_p25/p50/p75``). Where the records
    say when each request was handed to its rank, the same share against the time from then
    (``ttft_predicted_dispatched_25pct``: the engines' part, without the front end's) and the
    front end's mean (``dispatch_mean_ms``)."""
    measured = [r["first_token_s"] - r["arrival_s"] for r in rows]
    pairs = [(p, t) for p, t in zip(predicted or (), measured) if p is not None and t > 0]
    if not pairs:
        return {}
    ratios = sorted(p / t for p, t in pairs)
    out = {"ttft_predicted_requests": len(ratios), "ttft_predicted_25pct": _within(ratios, 0.25)}
    for q in (25, 50, 75):
        out[f"ttft_predicted_ratio_p{q}"] = percentile(ratios, q)
    timed = [(p, t, d) for p, t, d in zip(predicted or (), measured, dispatch or ())
             if p is not None and d is not None and t > d]
    if timed:
        out["ttft_predicted_dispatched_25pct"] = _within([p / (t - d) for p, t, d in timed], 0.25)
        out["dispatch_mean_ms"] = 1e3 * sum(d for _, _, d in timed) / len(timed)
    return out


def _within(ratios: list[float], tolerance: float) -> float:
    return sum(1 - tolerance <= x <= 1 + tolerance for x in ratios) / len(ratios)


def scalar_items(metrics: dict) -> dict[str, float]:
    """Every numeric figure of a run's metrics, phase figures as ``phase/metric``."""
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for phase, pm in metrics.get("phases", {}).items():
        flat.update({f"{phase}/{k}": v for k, v in pm.items() if isinstance(v, (int, float))})
    return flat


def summarize(runs: list[dict]) -> dict:
    """``{workload: {policy: {metric: interval + values + reps}}}`` over completed runs."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        if run["status"] == "ok":
            grouped.setdefault(run["workload"], {}).setdefault(run["policy"], []).append(run)
    summary: dict = {}
    for workload, policies in grouped.items():
        for policy, prs in policies.items():
            flat = [(r["rep"], scalar_items(r["metrics"])) for r in sorted(prs, key=lambda r: r["rep"])]
            keys = sorted({k for _, items in flat for k in items})
            out = {}
            for key in keys:
                pairs = [(rep, items[key]) for rep, items in flat if items.get(key) is not None]
                if pairs:
                    out[key] = confidence_interval([v for _, v in pairs]) | {
                        "values": [v for _, v in pairs], "reps": [rep for rep, _ in pairs]}
            summary.setdefault(workload, {})[policy] = out
    return summary


def claim(difference: dict, higher_is_better: bool) -> str | None:
    """"ahead" / "behind" when the paired difference's interval (candidate - baseline) lies
    wholly on the good / bad side of zero, "level" when it holds zero, None without one."""
    if difference.get("low") is None:
        return None
    good_low, good_high = (difference["low"], difference["high"]) if higher_is_better else (
        -difference["high"], -difference["low"])
    if good_low > 0:
        return "ahead"
    if good_high < 0:
        return "behind"
    return "level"


def paired_change(summary_wl: dict, candidate: str, baseline: str, metric: str) -> dict | None:
    """Candidate against baseline on one metric, paired by repetition: the interval of the
    per-repetition differences (the claim rests on it) and of the relative changes."""
    a, b = summary_wl.get(candidate, {}).get(metric), summary_wl.get(baseline, {}).get(metric)
    if a is None or b is None:
        return None
    base = dict(zip(b["reps"], b["values"]))
    pairs = [(v, base[rep]) for rep, v in zip(a["reps"], a["values"]) if rep in base]
    if not pairs:
        return None
    higher = HEADLINE.get(metric.split("/")[-1], True)
    difference = confidence_interval([x - y for x, y in pairs])
    ratios = [x / y - 1.0 for x, y in pairs if y]
    return {"difference": difference | {"values": [x - y for x, y in pairs]},
            "relative_change": (confidence_interval(ratios) | {"values": ratios}) if ratios else None,
            "claim": claim(difference, higher), "higher_is_better": higher}
