"""End to end: load skew and memory skew under every policy of the runtime side by side:
the peers (round robin, least loaded, LMPool's reimplementations of SGLang's cache-aware and
Dynamo's KV routing rules), LMPool as a user gets it (its default mode), LMPool routing only,
and LMPool with each transfer mode (background copy, foreground move, both, pulls, all).

- load skew: 3 warm-ups build one long prefix per hot group, then 189 requests revisit
  those 3 groups, so all the load lands on a few prefixes;
- memory skew: 6 session prefixes are built on the source ranks (the first half), 30
  pressure requests pinned there share only a session's first block and fill memory with
  cold tokens, then 36 routed requests reuse the whole session prefixes;
- sessions, agent sessions (even or Zipf-popular preambles) and chat (only when named,
  ``--workloads sessions,agent_sessions,agent_sessions_zipf,agent_sessions_scaleout,chat``):
  multi-turn sessions whose histories grow turn by turn under KV pressure (``sessions.py``),
  and a chat service of a few tenants' system prompts under unique traffic (``chat_service.py``).

A transfer mode this build does not accept is recorded as ``unavailable`` and the suite
goes on. See ``eval_suite`` for the run order and ``benchmarks/README.md`` for the metrics.

    python -m benchmarks.benchmark_e2e --quick                              # CPU, five-way
    python -m benchmarks.benchmark_e2e --device cuda --preset 0.6b --world-size 4 \\
        --dtype bfloat16 --block-size 256 --reps 5 --mps                     # 4 replicas on one GPU

Writes one JSON (``--json``; default ``eval_<device>_<preset>_e2e.json`` under the temporary directory's
``lmpool-eval/``: the committed results change only when ``--json`` names them);
``benchmarks/plot_results.py`` draws its figures.
"""

from __future__ import annotations

import argparse
import sys


from benchmarks.stats.eval_metrics import paired_change
from benchmarks.eval_suite import (
    CANDIDATES, GATEWAYS, LMPOOL, LMPOOL_ROUTING, PEER_VARIANTS, PEERS, TRANSFER_MODES, TRANSFERS_IDLE,
    add_arguments, chosen_policies, file_traces, finish_arguments, run_suite, vocab_size,
)
from benchmarks.workloads.chat_service import chat_service
from benchmarks.workloads.sessions import agent_sessions, agent_sessions_scaleout, agent_sessions_zipf, sessions
from benchmarks.workloads.traces import load_skew, memory_skew

POLICIES = (*PEERS, LMPOOL, LMPOOL_ROUTING, *TRANSFER_MODES, TRANSFERS_IDLE, *PEER_VARIANTS, *GATEWAYS, *CANDIDATES)
MODE_NAMES = {p.name for p in (*TRANSFER_MODES, LMPOOL)}
QUICK_POLICIES = "round_robin,least_loaded,lmpool,lmpool-routing,lmpool+background,lmpool+foreground"
WORKLOADS = ("load_skew", "memory_skew")  # the paper's; "sessions" runs when named
POOL_BLOCKS = 384  # whole-pool KV budget: 96 blocks per worker at 4 replicas
COMPARED = ("throughput_tok_s", "ttft_mean_ms", "e2e_mean_ms", "tpot_mean_ms", "dp_tok_reuse",
            "reuse/ttft_mean_ms", "revisit/ttft_mean_ms")


def comparisons(summary: dict) -> dict:
    """Per workload: every policy against LMPool routing only and against round robin
    (paired by repetition), and whether a transfer mode (the default's included) beats routing
    only on mean TTFT and on throughput or mean E2E, each by the paired interval (the
    acceptance figure)."""
    out: dict = {}
    verdicts = {}
    for workload, by_policy in sorted(summary.items()):
        rows = {}
        for baseline in ("lmpool-routing", "round_robin"):
            if baseline in by_policy:
                rows[f"vs_{baseline}"] = {
                    p: {m: paired_change(by_policy, p, baseline, m) for m in COMPARED}
                    for p in sorted(by_policy) if p != baseline}
        out[workload] = rows
        wins = []
        for mode, row in rows.get("vs_lmpool-routing", {}).items():
            if mode not in MODE_NAMES:  # routing-only variants, the idle-transfers control
                continue
            said = {m: (row.get(m) or {}).get("claim") for m in ("ttft_mean_ms", "throughput_tok_s", "e2e_mean_ms")}
            if said["ttft_mean_ms"] == "ahead" and "ahead" in (said["throughput_tok_s"], said["e2e_mean_ms"]):
                wins.append(mode)
        verdicts[workload] = wins
    out["acceptance"] = {"transfer_beats_routing_only": verdicts,
                         "met": any(verdicts.values()) if verdicts else False}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--workloads",
                    help="default load_skew,memory_skew (none with --trace); also: sessions, agent_sessions, "
                         "agent_sessions_zipf, agent_sessions_scaleout, chat")
    args = finish_arguments(ap.parse_args(argv), POOL_BLOCKS, "e2e")
    policies = chosen_policies(args, POLICIES, QUICK_POLICIES)
    vocab = vocab_size(args)
    makers = {
        "load_skew": lambda seed: load_skew(seed, vocab, args.scale, args.max_tokens),
        "memory_skew": lambda seed: memory_skew(seed, vocab, args.world_size, args.scale, args.max_tokens),
        "sessions": lambda seed: sessions(seed, vocab, args.scale, args.max_tokens),
        "agent_sessions": lambda seed: agent_sessions(seed, vocab, args.scale, args.max_tokens),
        "agent_sessions_zipf": lambda seed: agent_sessions_zipf(seed, vocab, args.scale, args.max_tokens),
        "agent_sessions_scaleout": lambda seed: agent_sessions_scaleout(seed, vocab, args.scale, args.max_tokens),
        "chat": lambda seed: chat_service(seed, vocab, args.scale, args.max_tokens),
    }
    names = args.workloads.split(",") if args.workloads else [] if args.trace else list(WORKLOADS)
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(makers)}")
    traces = {n: {r: makers[n](args.seed + r) for r in args.rep_ids} for n in names} | file_traces(args)
    return run_suite(args, "e2e", traces, policies, comparisons)


if __name__ == "__main__":
    main(sys.argv[1:])
