"""Routing: the locality workload at 1x/3x/5x shared-prefix length under every routing
policy (LMPool, round robin, least loaded, and LMPool's reimplementations of SGLang's
cache-aware and Dynamo's KV routing rules, current and older); LMPool as a user gets it (its
default mode) and routing only (``lmpool-routing``).

192 requests over 16 recurring groups (12 each, seeded shuffled order) whose shared
prefixes hold 1,911 / 5,655 / 9,399 tokens at scale 1. Every policy replays the same
trace on a fresh pool; see ``eval_suite`` for the run order and ``benchmarks/README.md``
for every metric.

    python -m benchmarks.benchmark_kv_routing --quick                      # CPU, about a minute
    python -m benchmarks.benchmark_kv_routing --quick --policies all       # CPU, every policy
    python -m benchmarks.benchmark_kv_routing --device cuda --preset 0.6b --world-size 4 \\
        --dtype bfloat16 --block-size 256 --reps 5 --mps                    # 4 replicas on one GPU
    python -m benchmarks.benchmark_kv_routing ... --levels 5 --sweep kv_budget=48,96,192,384,768  # budget sweep

Writes one JSON (``--json``; default ``eval_<device>_<preset>_kv_routing.json`` under the temporary
directory's ``lmpool-eval/``: the committed results change only when ``--json`` names them);
``benchmarks/plot_results.py`` draws its figures.
"""

from __future__ import annotations

import argparse
import sys


from benchmarks.stats.eval_metrics import paired_change
from benchmarks.peers.eval_policies import PEER_NAMES
from benchmarks.eval_suite import (
    CANDIDATES, GATEWAYS, LMPOOL, LMPOOL_ROUTING, LMPOOL_VARIANTS, PEER_VARIANTS, PEERS, add_arguments,
    chosen_policies, file_traces, finish_arguments, run_suite, vocab_size,
)
from benchmarks.replay.eval_settings import trace_of
from benchmarks.workloads.traces import LOCALITY_LEVELS, locality

POLICIES = (LMPOOL, LMPOOL_ROUTING, *PEERS, *PEER_VARIANTS, *LMPOOL_VARIANTS, *GATEWAYS, *CANDIDATES)
QUICK_POLICIES = "lmpool,round_robin,least_loaded"
POOL_BLOCKS = 768  # whole-pool KV budget: 192 blocks per worker at 4 replicas
COMPARED = ("throughput_tok_s", "ttft_mean_ms", "ttft_p99_ms", "e2e_mean_ms", "tpot_mean_ms", "dp_tok_reuse")
GOALS = {"throughput_gain": 0.25, "ttft_reduction": 0.30}


def comparisons(summary: dict) -> dict:
    """LMPool against every peer at every level and setting (paired by repetition), and the
    acceptance figures at the longest prefix (of the first setting with it): throughput gain
    and mean-TTFT reduction over round robin, and the peers LMPool is behind on a headline
    metric by the paired interval."""
    out: dict = {}
    for workload, by_policy in sorted(summary.items()):
        if "lmpool" not in by_policy:
            continue
        out[workload] = {peer: {m: paired_change(by_policy, "lmpool", peer, m) for m in COMPARED}
                         for peer in sorted(by_policy) if peer != "lmpool"}
    levels = [w for w in out if w.startswith("locality_")]
    if levels:
        longest = max(map(level_of, levels))
        tops = {w: acceptance_at(out[w], w) for w in sorted(levels)
                if level_of(w) == longest and "round_robin" in out[w]}
        if tops:
            out["acceptance"] = next(iter(tops.values()))
            if len(tops) > 1:  # a sweep: the same figures under every setting
                out["acceptance_by_setting"] = tops
    return out


def acceptance_at(row: dict, workload: str) -> dict:
    vs_rr = row["round_robin"]
    acceptance: dict = {"workload": workload}
    # A TTFT reduction is the relative change with its sign flipped.
    for key, metric, sign in (("throughput_gain", "throughput_tok_s", 1.0), ("ttft_reduction", "ttft_mean_ms", -1.0)):
        change = vs_rr.get(metric)
        if change is None or change["relative_change"] is None:
            continue
        ci = change["relative_change"]
        bounds = [sign * b for b in (ci["low"], ci["high"]) if b is not None]
        acceptance[key] = {"mean": sign * ci["mean"], "low": min(bounds) if bounds else None,
                           "high": max(bounds) if bounds else None, "n": ci["n"], "goal": GOALS[key],
                           "goal_met": sign * ci["mean"] >= GOALS[key], "claim": change["claim"]}
    acceptance["peers_better_beyond_ci"] = sorted(  # LMPool's own variants are not peers
        f"{peer}:{m}" for peer, r in row.items() for m in ("throughput_tok_s", "ttft_mean_ms", "e2e_mean_ms")
        if peer in PEER_NAMES and r.get(m) and r[m]["claim"] == "behind")
    return acceptance


def level_of(workload: str) -> int:
    """The shared-prefix multiple of a locality key (``locality_5x`` or ``locality_5x@kv96_w16``)."""
    return int(trace_of(workload).split("_")[1][:-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--levels", help="shared-prefix multiples to run (default 1,3,5; none with --trace)")
    args = finish_arguments(ap.parse_args(argv), POOL_BLOCKS, "kv_routing")
    if args.levels is None:
        args.levels = "" if args.trace else ",".join(map(str, LOCALITY_LEVELS))
    try:
        levels = [int(x) for x in args.levels.split(",") if x]
    except ValueError:
        raise SystemExit(f"--levels takes comma-separated integers, got {args.levels!r}") from None
    if any(lvl < 1 for lvl in levels):
        raise SystemExit(f"--levels must be >= 1, got {args.levels!r}")
    policies = chosen_policies(args, POLICIES, QUICK_POLICIES)
    vocab = vocab_size(args)
    traces = {f"locality_{lvl}x": {r: locality(lvl, args.seed + r, vocab, args.scale, args.max_tokens)
                                   for r in args.rep_ids} for lvl in levels} | file_traces(args)
    return run_suite(args, "kv_routing", traces, policies, comparisons)


if __name__ == "__main__":
    main(sys.argv[1:])
